"""foak.ops.linear_jsd (forward KL / reverse KL / generalized JSD between a student's and a teacher's LM head,
chunked over tokens) against an independent fp64 computation on the full logits: loss, student entropy and the
gradients of the student's hidden states, weight and bias; the Triton row kernel in the interpreter and the
torch reference backend."""

import math

import pytest
import torch

import foak
import foak.ops.linear_jsd as jsd_module
from foak.ops.linear_jsd import linear_jsd
from foak.testing import relative_error

# (N, H_student, H_teacher, V): odd sizes, teacher narrower than the student, V not a power of two
SHAPE = (13, 33, 20, 301)
BETAS = [0.0, 0.5, 1.0]
# fp32: the kernel's fp32 math against fp64; bf16: bf16 GEMM operands (the reference sees the same rounded
# values) and a bf16 gradient tile / bf16 gradients
TOL = {torch.float32: dict(loss=2e-6, grad=2e-5), torch.bfloat16: dict(loss=2e-4, grad=2e-2),
       torch.float16: dict(loss=2e-4, grad=5e-3)}
# every knob on: temperature, a softcap that bites (logits ~ N(0, 4)), another scale for the teacher, biases,
# masked tokens, several chunks (5 rows each, so a chunk boundary falls inside the valid rows) and several
# vocabulary blocks per row in the kernel (128 + 128 + a tail of 45: the online log-sum-exp's rescaling)
FULL = dict(temperature=0.7, student_softcap=4.0, teacher_logit_scale=1.5, bias=True, masked=True, chunk_rows=5,
            block=128)
PLAIN = dict(temperature=1.0, student_softcap=None, teacher_logit_scale=1.0, bias=False, masked=False,
             chunk_rows=None, block=4096)


def make_inputs(n, hs, ht, vocab, dtype, bias, masked, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    inputs = dict(student_hidden=randn(n, hs), student_weight=randn(vocab, hs, scale=2 / math.sqrt(hs)),
                  teacher_hidden=randn(n, ht), teacher_weight=randn(vocab, ht, scale=2 / math.sqrt(ht)),
                  student_bias=randn(vocab, scale=0.5) if bias else None,
                  teacher_bias=randn(vocab, scale=0.5) if bias else None)
    mask = None
    if masked:  # prompt-like runs of ignored tokens at both ends and one inside
        mask = torch.ones(n, dtype=torch.long)
        mask[:3] = 0
        mask[7] = 0
        mask[-2:] = 0
    return inputs, mask


def fp64_reference(inputs, mask, beta, temperature=1.0, student_logit_scale=1.0, teacher_logit_scale=1.0,
                   student_softcap=None, teacher_softcap=None, reduction="mean", num_items_in_batch=None):
    """The divergence written out on full fp64 probabilities (the mixture m formed directly, not in log space);
    returns (loss, entropy, per-token divergence, {name: leaf}) with the student's leaves requiring grad."""
    leaves = {k: inputs[k].double().requires_grad_() for k in ("student_hidden", "student_weight", "student_bias")
              if inputs[k] is not None}

    def probs(hidden, weight, bias, scale, cap):
        y = hidden @ weight.t() + (bias if bias is not None else 0)
        z = y * scale
        if cap is not None:
            z = cap * torch.tanh(z / cap)
        return torch.softmax(z / temperature, -1)

    ps = probs(leaves["student_hidden"], leaves["student_weight"], leaves.get("student_bias"), student_logit_scale,
               student_softcap)
    tb = inputs["teacher_bias"]
    pt = probs(inputs["teacher_hidden"].double(), inputs["teacher_weight"].double(),
               tb.double() if tb is not None else None, teacher_logit_scale, teacher_softcap)
    if beta == 0:
        per = (pt * (pt.log() - ps.log())).sum(-1)
    elif beta == 1:
        per = (ps * (ps.log() - pt.log())).sum(-1)
    else:
        m = (1 - beta) * ps + beta * pt
        per = beta * (pt * (pt.log() - m.log())).sum(-1) + (1 - beta) * (ps * (ps.log() - m.log())).sum(-1)
    ent = -(ps * ps.log()).sum(-1).detach()
    valid = torch.ones_like(per, dtype=torch.bool) if mask is None else mask != 0
    per, ent = per * valid, ent * valid
    count = max(int(valid.sum()), 1)
    if reduction == "none":
        return per, ent, per, leaves
    if reduction == "sum":
        return per.sum(), ent.sum(), per, leaves
    return per.sum() / (num_items_in_batch or count), ent.sum() / count, per, leaves


def run_foak(inputs, mask, upstream=None, **options):
    leaves = {k: v.detach().clone().requires_grad_() if k.startswith("student") else v
              for k, v in inputs.items() if v is not None}
    loss, ent = linear_jsd(**leaves, mask=mask, return_entropy=True, **options)
    wanted = [leaves[k] for k in ("student_hidden", "student_weight", "student_bias") if k in leaves]
    grads = torch.autograd.grad(loss, wanted, torch.ones(()) if upstream is None else upstream)
    return loss.detach(), ent, dict(zip(("student_hidden", "student_weight", "student_bias"), grads))


def check(inputs, mask, beta, dtype, upstream=None, **options):
    ref_loss, ref_ent, _, ref_leaves = fp64_reference(
        inputs, mask, beta, **{k: v for k, v in options.items() if k != "accum_dtype"})
    ref_grads = torch.autograd.grad(ref_loss, list(ref_leaves.values()),
                                    torch.ones((), dtype=torch.float64) if upstream is None else upstream.double())
    loss, ent, grads = run_foak(inputs, mask, upstream, beta=beta, **options)
    tol = TOL[dtype]
    assert loss.dtype == torch.float32 and loss.shape == ref_loss.shape
    assert relative_error(loss, ref_loss) <= tol["loss"], (loss, ref_loss)
    assert relative_error(ent, ref_ent) <= tol["loss"], (ent, ref_ent)
    for name, ref in zip(ref_leaves, ref_grads):
        assert grads[name].dtype == inputs[name].dtype and grads[name].shape == ref.shape, name
        assert ref.abs().max() > 0, name
        assert relative_error(grads[name], ref) <= tol["grad"], (name, relative_error(grads[name], ref))
    return loss, grads


def _options(variant):
    return {k: v for k, v in variant.items() if k not in ("bias", "masked", "chunk_rows", "block")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("variant", [FULL, PLAIN], ids=["full", "plain"])
def test_kernel_matches_fp64_on_full_logits(monkeypatch, dtype, beta, variant):
    monkeypatch.setitem(jsd_module.TUNING, "chunk_rows", variant["chunk_rows"])
    monkeypatch.setitem(jsd_module.TUNING, "block", variant["block"])
    inputs, mask = make_inputs(*SHAPE, dtype, variant["bias"], variant["masked"])
    loss, _ = check(inputs, mask, beta, dtype, **_options(variant))
    assert loss > 0.05  # the two heads disagree: the test can tell a wrong divergence from a right one


def test_kernel_runs_each_chunk_once_and_skips_masked_tokens(monkeypatch):
    launches = []
    launch = jsd_module._launch_rows
    monkeypatch.setattr(jsd_module, "_launch_rows", lambda s, *a, **k: (launches.append(s.shape), launch(s, *a, **k)))
    monkeypatch.setitem(jsd_module.TUNING, "chunk_rows", 5)
    inputs, mask = make_inputs(*SHAPE, torch.float32, True, True)
    run_foak(inputs, mask, beta=0.5)
    # 13 tokens, 6 masked: chunks of 5 and 2 rows, one launch each (the gradient comes from the forward)
    assert launches == [(5, SHAPE[3]), (2, SHAPE[3])]


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_sum_and_per_token_reductions(monkeypatch, reduction):
    monkeypatch.setitem(jsd_module.TUNING, "chunk_rows", 4)
    inputs, mask = make_inputs(*SHAPE, torch.float32, True, True, seed=1)
    upstream = torch.randn(SHAPE[0]) if reduction == "none" else torch.tensor(0.37)
    loss, _ = check(inputs, mask, 0.3, torch.float32, upstream=upstream, reduction=reduction, temperature=1.3,
                    teacher_softcap=3.0, student_logit_scale=0.8)
    if reduction == "none":
        assert (loss[mask == 0] == 0).all() and (loss[mask != 0] > 0).all()


@pytest.mark.parametrize("accum_dtype", [torch.float32, None], ids=["fp32", "weight-dtype"])
def test_bf16_weight_gradient_accumulated_across_chunks(monkeypatch, accum_dtype):
    monkeypatch.setitem(jsd_module.TUNING, "chunk_rows", 3)  # 7 valid tokens: three chunks
    inputs, mask = make_inputs(*SHAPE, torch.bfloat16, True, True, seed=7)
    check(inputs, mask, 0.5, torch.bfloat16, accum_dtype=accum_dtype)


def test_num_items_in_batch_and_leading_dims():
    inputs, mask = make_inputs(*SHAPE, torch.float32, False, True, seed=2)
    ref_loss, _, _, _ = fp64_reference(inputs, mask, 0.5, num_items_in_batch=20)
    shaped = {k: v.reshape(1, SHAPE[0], -1) if k.endswith("hidden") else v for k, v in inputs.items()}
    loss = linear_jsd(**{k: v for k, v in shaped.items() if v is not None}, mask=mask.reshape(1, -1),
                      num_items_in_batch=20)
    assert relative_error(loss, ref_loss) <= 2e-6


def test_fp16_computes_the_gradient_in_the_backward():
    inputs, mask = make_inputs(*SHAPE, torch.float16, True, True, seed=3)
    check(inputs, mask, 0.5, torch.float16, upstream=torch.tensor(2.0), temperature=0.9)


def test_autocast_gives_an_fp32_master_weight_an_fp32_gradient():
    inputs, mask = make_inputs(*SHAPE, torch.float32, True, True, seed=4)
    # the reference sees the bf16-rounded operands the autocast GEMMs see
    rounded = {k: v.to(torch.bfloat16).float() if v is not None else None for k, v in inputs.items()}
    ref_loss, _, _, ref_leaves = fp64_reference(rounded, mask, 0.5)
    ref_dw = torch.autograd.grad(ref_loss, ref_leaves["student_weight"])[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _, grads = run_foak(inputs, mask, beta=0.5)
    assert grads["student_weight"].dtype == torch.float32
    assert relative_error(loss, ref_loss) <= 2e-4
    assert relative_error(grads["student_weight"], ref_dw) <= 2e-2


def test_without_grad_the_forward_matches_and_computes_no_gradient(monkeypatch):
    writes = []
    launch = jsd_module._launch_rows
    monkeypatch.setattr(jsd_module, "_launch_rows", lambda *a: (writes.append(a[-1]), launch(*a)))
    inputs, mask = make_inputs(*SHAPE, torch.float32, True, True, seed=5)
    with_grad, ent, _ = run_foak(inputs, mask, beta=0.5)
    with torch.no_grad():
        loss, no_grad_ent = linear_jsd(**{k: v for k, v in inputs.items() if v is not None}, mask=mask, beta=0.5,
                                       return_entropy=True)
    assert writes == [True, False]
    assert torch.equal(loss, with_grad) and torch.equal(no_grad_ent, ent)


def test_reference_backend_matches_fp64():
    inputs, mask = make_inputs(*SHAPE, torch.float32, True, True, seed=6)
    foak.set_backend("reference")
    try:
        for beta in BETAS:
            check(inputs, mask, beta, torch.float32, temperature=0.8, student_softcap=5.0, teacher_logit_scale=2.0)
    finally:
        foak.set_backend(None)


def test_bad_inputs_are_one_line_errors():
    inputs, mask = make_inputs(*SHAPE, torch.float32, False, True)
    args = {k: v for k, v in inputs.items() if v is not None}
    cases = [
        (dict(beta=1.5), "beta must be a number in [0, 1]"),
        (dict(temperature=0.0), "temperature must be a finite number > 0"),
        (dict(student_softcap=-1.0), "student_softcap must be None or a finite number > 0"),
        (dict(reduction="avg"), "reduction must be one of"),
        (dict(mask=mask[:-1]), "mask must be a tensor of shape (13,)"),
        (dict(teacher_weight=args["teacher_weight"][:-1]), "must share the vocabulary"),
        (dict(teacher_hidden=args["teacher_hidden"][:-1]), "must have the same leading shape"),
        (dict(student_weight=args["student_weight"].double()), "student_weight has dtype torch.float64"),
        (dict(student_hidden=args["student_hidden"].bfloat16()), "tensors must share one dtype"),
        (dict(accum_dtype=torch.bfloat16), "accum_dtype must be torch.float32 or None"),
    ]
    for override, message in cases:
        with pytest.raises(ValueError, match="linear_jsd: ") as info:
            linear_jsd(**{**args, **override})
        assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
