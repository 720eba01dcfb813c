"""linear_log_probs (ops/linear_log_probs.py): per-token log-probs, entropy, log sum p^2, mean logit and top-1
of a linear layer's softmax, vs an fp64 computation on the full logits (the kernels run in the interpreter)."""

import math

import pytest
import torch

import foak.ops.linear_cross_entropy as lce_module
import foak.ops.linear_log_probs as llp_module
from foak.ops.linear_log_probs import OUTPUTS, linear_log_probs, linear_log_probs_reference
from foak.testing import relative_error

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
ALL = dict(entropy=True, log_sum_sq_probs=True, mean_logits=True, is_top1=True)
# (temperature, logit_scale, softcap): plain; a scale and a temperature; a softcap between them
TRANSFORMS = [(1.0, 1.0, None), (0.7, 1.3, None), (1.3, 0.5, 5.0)]


def make_inputs(n, h, vocab, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(vocab, h, generator=g) * (2 / math.sqrt(h))).to(dtype)
    b = (torch.randn(vocab, generator=g) * 0.5).to(dtype) if bias else None
    target = torch.randint(0, vocab, (n,), generator=g)
    logits = hidden.double() @ weight.double().t()
    target[::3] = logits.argmax(-1)[::3]  # some rows predicted right: is_top1 is not all False
    target[1::7] = -100  # ignored rows
    return hidden, weight, b, target


def fp64_outputs(hidden, weight, target, bias, temperature, logit_scale, softcap):
    """The five outputs (ignored rows 0/False) from fp64 logits; log_probs and entropy keep their graph."""
    x = hidden.double() @ weight.double().t() + (bias.double() if bias is not None else 0)
    y = x * logit_scale
    z = (softcap * torch.tanh(y / softcap) if softcap is not None else y) / temperature
    valid = target != -100
    safe = target.clamp(min=0)
    log_p = z - torch.logsumexp(z, -1, keepdim=True)
    p = log_p.exp()
    zero = torch.zeros((), dtype=torch.float64)
    first_max = z.argmax(-1)  # torch: the first maximum
    return (torch.where(valid, log_p.gather(1, safe[:, None]).squeeze(1), zero),
            torch.where(valid, -(p * log_p).sum(-1), zero),
            torch.where(valid, (p * p).sum(-1).log(), zero).detach(),
            torch.where(valid, z.mean(-1), zero).detach(),
            valid & (first_max == safe))


def run(fn, hidden, weight, bias, target, d_logp, d_ent, **kwargs):
    """fn on fresh leaves: (outputs, gradients of hidden, weight and bias)."""
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias) if t is not None]
    out = fn(leaves[0], leaves[1], target, leaves[2] if bias is not None else None, **kwargs)
    loss = (out[0] * d_logp).sum() + ((out[1] * d_ent).sum() if d_ent is not None else 0)
    grads = torch.autograd.grad(loss, leaves)
    return [o.detach() if o is not None else None for o in out], grads


def check(n, h, vocab, dtype, bias, transform, wanted=ALL, entropy_grad=True, seed=0):
    temperature, logit_scale, softcap = transform
    hidden, weight, b, target = make_inputs(n, h, vocab, dtype, bias, seed)
    g = torch.Generator().manual_seed(seed + 1)
    d_logp = torch.randn(n, generator=g)
    d_ent = torch.randn(n, generator=g) if entropy_grad else None
    options = dict(temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    out, grads = run(linear_log_probs, hidden, weight, b, target, d_logp, d_ent, **options, **wanted)
    ref, ref_grads = run(lambda *a, **k: fp64_outputs(*a, **options), hidden, weight, b, target,
                         d_logp.double(), d_ent.double() if entropy_grad else None)
    tol = TOL[dtype]
    for name, got, want in zip(OUTPUTS, out, ref):
        if name != "log_probs" and not wanted.get(name):
            assert got is None, name
            continue
        assert got.shape == target.shape, name
        if name == "is_top1":
            assert got.dtype == torch.bool
            if dtype == torch.float32:  # bf16 logits may swap near-ties
                assert torch.equal(got, want) and 0 < int(got.sum()) < n
            continue
        assert got.dtype == torch.float32, name
        assert (got[target == -100] == 0).all(), name
        assert relative_error(got, want) < tol, (name, relative_error(got, want))
    for name, got, want in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert got.dtype == dtype, name
        assert relative_error(got, want) < tol * (2 if dtype == torch.bfloat16 else 1), (name,
                                                                                         relative_error(got, want))
    assert (grads[0][target == -100] == 0).all()  # ignored rows get no gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "transform"), [((37, 33, 129, True), TRANSFORMS[0]),
                                                   ((13, 65, 1000, False), TRANSFORMS[1]),
                                                   ((21, 17, 203, True), TRANSFORMS[2])])
def test_outputs_and_gradients_match_fp64(dtype, shape, transform):
    check(*shape[:3], dtype, shape[3], transform)


def test_vocabulary_in_several_blocks_and_rows_in_several_chunks(monkeypatch):
    # 3 blocks of 64 over a vocabulary of 150 in each row; 16 rows per chunk over 37 rows (11 with -100 below)
    monkeypatch.setitem(llp_module.TUNING, "block", 64)
    monkeypatch.setitem(llp_module.TUNING, "forward_blocks", (64,) * 4)
    monkeypatch.setitem(lce_module.TUNING, "chunk_rows", 16)
    check(37, 19, 150, torch.float32, True, TRANSFORMS[2])


@pytest.mark.parametrize("wanted,entropy_grad", [({}, False), ({"entropy": True}, False),
                                                 ({"mean_logits": True, "is_top1": True}, False)])
def test_subsets_of_the_outputs(wanted, entropy_grad):
    check(13, 17, 77, torch.float32, False, TRANSFORMS[1], wanted=wanted, entropy_grad=entropy_grad)


def test_entropy_gradient_alone():
    hidden, weight, _, target = make_inputs(11, 9, 50, torch.float32, False)
    d_ent = torch.randn(11)
    leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    ent = linear_log_probs(*leaves, target, entropy=True).entropy
    grads = torch.autograd.grad((ent * d_ent).sum(), leaves)
    ref_leaves = [t.double().requires_grad_() for t in (hidden, weight)]
    ref = fp64_outputs(*ref_leaves, target, None, 1.0, 1.0, None)[1]
    for got, want in zip(grads, torch.autograd.grad((ref * d_ent.double()).sum(), ref_leaves)):
        assert relative_error(got, want) < 1e-5


def test_is_top1_is_the_first_maximum():
    # vocabulary entries 3 and 5 have the same weights: the same logit; a target 5 where they are the
    # maximum is not the top-1 (the argmax is 3), target 3 is
    hidden, weight, _, _ = make_inputs(8, 6, 10, torch.float32, False)
    weight[5] = weight[3]
    hidden = weight[3].repeat(8, 1) * 3 + 0.01 * hidden  # rows whose maximum is entries 3 and 5
    target = torch.tensor([3, 5, 3, 5, 3, 5, 3, 5])
    top1 = linear_log_probs(hidden, weight, target, is_top1=True).is_top1
    assert top1.tolist() == [True, False] * 4


def test_no_grad_saves_nothing_and_training_saves_no_logits():
    hidden, weight, b, target = make_inputs(37, 33, 129, torch.float32, True)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, b)]
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.no_grad():
            linear_log_probs(*leaves[:2], target, leaves[2], **ALL)
        assert saved == []  # the reference model's forward keeps nothing
        out = linear_log_probs(*leaves[:2], target, leaves[2], **ALL)
    assert saved and max(saved) < 37 * 129  # inputs and row statistics only, no [N, V] tensor
    assert not any(t.requires_grad for t in out[2:4]) and out.log_probs.requires_grad and out.entropy.requires_grad


def test_bf16_autocast_over_fp32_weights_and_an_fp32_head_over_bf16_weights():
    hidden, weight, b, target = make_inputs(13, 17, 77, torch.float32, True)
    d = torch.randn(13)
    ref, ref_grads = run(lambda *a, **k: fp64_outputs(*a, 1.0, 1.0, None), hidden, weight, b, target, d.double(),
                         None)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # GEMMs in bf16, fp32 gradients of the fp32 weights
        out, grads = run(linear_log_probs, hidden, weight, b, target, d, None)
    assert [g.dtype for g in grads] == [torch.float32] * 3
    assert relative_error(out[0], ref[0]) < 2e-2 and all(relative_error(g, r) < 4e-2 for g, r in zip(grads, ref_grads))
    # fp32 hidden over bf16 weights outside autocast: the GEMMs in fp32 (TRL's cast_lm_head_to_fp32)
    w16, b16 = weight.bfloat16(), b.bfloat16()
    ref, _ = run(lambda *a, **k: fp64_outputs(*a, 1.0, 1.0, None), hidden, w16, b16, target, d.double(), None)
    out, grads = run(linear_log_probs, hidden, w16, b16, target, d, None)
    assert relative_error(out[0], ref[0]) < 1e-5 and [g.dtype for g in grads] == [torch.float32, torch.bfloat16,
                                                                                    torch.bfloat16]


def test_no_scored_row():
    hidden, weight, _, _ = make_inputs(4, 6, 10, torch.float32, False)
    h = hidden[:0].clone().requires_grad_()
    out = linear_log_probs(h, weight, torch.zeros(0, dtype=torch.long), entropy=True)
    assert out.log_probs.shape == (0,)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert h.grad.shape == (0, 6)
    all_ignored = torch.full((4,), -100)
    h = hidden.clone().requires_grad_()
    linear_log_probs(h, weight, all_ignored).log_probs.sum().backward()
    assert (h.grad == 0).all()


def test_reference_backend_matches_fp64(reference_ops):
    for transform in TRANSFORMS:
        check(13, 17, 77, torch.float32, True, transform)


def test_reference_is_the_kernels_math():
    hidden, weight, b, target = make_inputs(13, 17, 77, torch.float32, True)
    for transform in TRANSFORMS:
        options = dict(zip(("temperature", "logit_scale", "softcap"), transform))
        got, want = linear_log_probs(hidden, weight, target, b, **options, **ALL), \
            linear_log_probs_reference(hidden, weight, target, b, **options, **ALL)
        for name, x, y in zip(OUTPUTS, got, want):
            assert torch.equal(x, y) if name == "is_top1" else relative_error(x, y) < 1e-5, name


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=0.0), "temperature must be non-zero"), (dict(logit_scale=math.inf), "logit_scale must be"),
    (dict(softcap=-1.0), "softcap must be None or > 0"), (dict(chunk_bytes=0), "chunk_bytes"),
    (dict(accum_dtype=torch.float16), "accum_dtype")])
def test_bad_options_are_one_line_errors(kwargs, match):
    hidden, weight, _, target = make_inputs(4, 6, 10, torch.float32, False)
    with pytest.raises(ValueError, match=match):
        linear_log_probs(hidden, weight, target, **kwargs)


def test_bad_inputs_are_one_line_errors():
    hidden, weight, _, target = make_inputs(4, 6, 10, torch.float32, False)
    with pytest.raises(ValueError, match="target must have hidden's leading shape"):
        linear_log_probs(hidden, weight, target[:3])
    with pytest.raises(ValueError, match="out of range"):
        linear_log_probs(hidden, weight, torch.tensor([0, 1, 2, 10]))
    with pytest.raises(ValueError, match=r"expected hidden \[..., H\]"):
        linear_log_probs(hidden, weight[:, :5], target)


@pytest.mark.parametrize("case", ["forward", "forward all", "backward", "backward entropy only"])
def test_custom_ops_pass_opcheck(case):
    # fake (meta) implementations and schemas agree with the kernels (torch.compile traces through them)
    hidden, head, bias = torch.randn(7, 13), torch.randn(301, 13), torch.randn(301)
    target = torch.tensor([3, -100, 0, 300, 17, -100, 5])
    ops = torch.ops.foak
    transform = (0.7, 1.3, 5.0, -100)
    if case.startswith("forward"):
        wanted = (True, True, True, True) if case == "forward all" else (False, False, False, False)
        input_grad = case == "forward all"
        op, args = ops.linear_log_probs_forward, (hidden, head, bias, target, *transform, *wanted, input_grad, None)
    else:
        d_logp = torch.randn(7) if case == "backward" else torch.empty(0)
        op, args = ops.linear_log_probs_backward, (d_logp, torch.randn(7), hidden, head, None, target,
                                                   torch.randn(2, 7), torch.rand(7), *transform, True, True,
                                                   case == "backward", False, 4096)
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))


# a frozen head (LoRA, QLoRA: only hidden needs a gradient): the forward computes each row's d log_probs / d hidden
# from the logits at hand and the backward scales it; an entropy that receives a gradient takes the recomputing path
def frozen_run(hidden, weight, bias, target, d_logp, d_ent, fn=linear_log_probs, **kwargs):
    h = hidden.detach().clone().requires_grad_()
    out = fn(h, weight, target, bias, **kwargs)
    loss = (out[0] * d_logp).sum() + ((out[1] * d_ent).sum() if d_ent is not None else 0)
    return [o.detach() if o is not None else None for o in out], torch.autograd.grad(loss, h)[0]


def count_recomputes(monkeypatch):
    import foak.ops.linear_log_probs as llp

    calls, backward = [], llp._backward_op
    monkeypatch.setattr(llp, "_backward_op", lambda *a: calls.append(1) or backward(*a))
    return calls


# each (entropy gradient, hint) pair in both dtypes and with the softcap; each transform with and without an entropy
# gradient (7 of the 18 combinations: CI time)
FROZEN_CASES = [(False, False, 0, torch.float32), (False, False, 2, torch.bfloat16),
                (True, False, 1, torch.bfloat16), (True, False, 2, torch.float32),
                (True, True, 0, torch.bfloat16), (True, True, 1, torch.float32), (True, True, 2, torch.bfloat16)]


@pytest.mark.parametrize("entropy_grad, hint, transform, dtype",
                         [(e, h, TRANSFORMS[t], d) for e, h, t, d in FROZEN_CASES])
def test_frozen_head_gradient_from_the_forward(monkeypatch, dtype, transform, entropy_grad, hint):
    # 3 blocks of 64 over a vocabulary of 150, 16 rows per chunk over 37 rows (ignored rows among them)
    monkeypatch.setitem(llp_module.TUNING, "block", 64)
    monkeypatch.setitem(llp_module.TUNING, "forward_blocks", (64,) * 4)
    monkeypatch.setitem(lce_module.TUNING, "chunk_rows", 16)
    recomputes = count_recomputes(monkeypatch)
    hidden, weight, b, target = make_inputs(37, 19, 150, dtype, True)
    g = torch.Generator().manual_seed(5)
    d_logp, d_ent = torch.randn(37, generator=g), (torch.randn(37, generator=g) if entropy_grad else None)
    options = dict(zip(("temperature", "logit_scale", "softcap"), transform))
    out, dh = frozen_run(hidden, weight, b, target, d_logp, d_ent, entropy=True, is_top1=True, entropy_grad=hint,
                         **options)
    # the logits are recomputed exactly when the entropy is differentiated or the forward was told it would be
    assert len(recomputes) == (1 if entropy_grad or hint else 0)
    ref, ref_dh = frozen_run(hidden, weight, b, target, d_logp.double(), d_ent.double() if entropy_grad else None,
                             fn=lambda h, w, t, bias, **k: fp64_outputs(h, w, t, bias, *transform))
    tol = TOL[dtype]
    assert relative_error(out[0], ref[0]) < tol and relative_error(out[1], ref[1]) < tol
    assert dh.dtype == dtype and relative_error(dh, ref_dh) < tol * (2 if dtype == torch.bfloat16 else 1)
    assert (dh[target == -100] == 0).all()
    # the same gradient as the recomputing backward (a trained head's) computes
    leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    trained = linear_log_probs(leaves[0], leaves[1], target, b, entropy=True, **options)
    loss = (trained.log_probs * d_logp).sum() + ((trained.entropy * d_ent).sum() if entropy_grad else 0)
    dh_trained = torch.autograd.grad(loss, leaves)[0]
    if dtype == torch.float32:
        assert relative_error(dh, dh_trained) < 1e-6
    else:  # one more bf16 rounding (of the unit gradient before its scaling): within 1.5x the other's error
        assert relative_error(dh, ref_dh) < 1.5 * relative_error(dh_trained, ref_dh) + 1e-3


def test_frozen_head_under_autocast_and_an_fp32_head_over_bf16_weights(monkeypatch):
    recomputes = count_recomputes(monkeypatch)
    hidden, weight, b, target = make_inputs(13, 17, 77, torch.float32, True)
    d = torch.randn(13)
    _, ref_dh = frozen_run(hidden, weight, b, target, d.double(), None,
                           fn=lambda h, w, t, bias, **k: fp64_outputs(h, w, t, bias, 1.0, 1.0, None))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, dh = frozen_run(hidden, weight, b, target, d, None)
    assert dh.dtype == torch.float32 and relative_error(dh, ref_dh) < 4e-2
    w16, b16 = weight.bfloat16(), b.bfloat16()  # TRL's cast_lm_head_to_fp32: fp32 hidden, bf16 frozen head
    _, ref_dh = frozen_run(hidden, w16, b16, target, d.double(), None,
                           fn=lambda h, w, t, bias, **k: fp64_outputs(h, w, t, bias, 1.0, 1.0, None))
    _, dh = frozen_run(hidden, w16, b16, target, d, None)
    assert dh.dtype == torch.float32 and relative_error(dh, ref_dh) < 1e-5
    assert recomputes == []


@pytest.mark.parametrize("hint", [False, True])
def test_frozen_head_keeps_one_row_gradient_and_no_logits(hint):
    hidden, weight, b, target = make_inputs(37, 33, 129, torch.float32, True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        linear_log_probs(hidden.clone().requires_grad_(), weight, target, b, **ALL, entropy_grad=hint)
    # hidden and its d log_probs / d hidden; with the hint hidden alone (the backward recomputes)
    assert saved.count((37, 33)) == (1 if hint else 2)
    assert all(math.prod(s) < 37 * 129 for s in saved)  # no [N, V] tensor


def test_entropy_grad_hint_without_an_entropy_gradient(monkeypatch):
    # the hint was wrong (the entropy is only logged): the backward recomputes, the gradient is the same
    recomputes = count_recomputes(monkeypatch)
    hidden, weight, b, target = make_inputs(37, 19, 150, torch.float32, True)
    d = torch.randn(37, generator=torch.Generator().manual_seed(4))
    _, dh = frozen_run(hidden, weight, b, target, d, None, entropy=True, entropy_grad=True)
    _, ref = frozen_run(hidden, weight, b, target, d.double(), None,
                        fn=lambda h, w, t, bias, **k: fp64_outputs(h, w, t, bias, 1.0, 1.0, None))
    assert len(recomputes) == 1 and relative_error(dh, ref) < 1e-5


def test_entropy_grad_hint_needs_the_entropy_and_is_ignored_for_a_trained_head(monkeypatch):
    hidden, weight, b, target = make_inputs(9, 8, 40, torch.float32, True)
    with pytest.raises(ValueError, match="entropy_grad=True needs entropy=True"):
        linear_log_probs(hidden, weight, target, b, entropy_grad=True)
    recomputes = count_recomputes(monkeypatch)
    leaves = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    out = linear_log_probs(*leaves, target, b, entropy=True, entropy_grad=True)
    got = torch.autograd.grad((out.log_probs + out.entropy).sum(), leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = linear_log_probs_reference(*ref_leaves, target, b.double(), entropy=True)
    want = torch.autograd.grad((ref.log_probs + ref.entropy).sum(), ref_leaves)
    assert len(recomputes) == 1  # a trained head: the recomputing backward, as without the hint
    assert all(relative_error(g, w) < 1e-5 for g, w in zip(got, want))


def test_frozen_head_under_torch_compile_matches_eager():
    # fullgraph through the autograd function and both custom ops (aot_eager: no inductor codegen on the CPU); under
    # compile the entropy's unused gradient arrives as zeros, so the recomputing backward runs: the same gradient
    hidden, weight, _, target = make_inputs(37, 16, 129, torch.float32, False)
    d = torch.randn(37)

    def step(h):
        out = linear_log_probs(h, weight, target, entropy=True, is_top1=True)
        return (out.log_probs * d).sum()

    h = hidden.clone().requires_grad_()
    want = torch.autograd.grad(step(h), h)[0]
    got = torch.autograd.grad(torch.compile(step, backend="aot_eager", fullgraph=True)(h), h)[0]
    assert relative_error(got, want) < 1e-5


def test_frozen_head_fp16_with_a_grad_scaler_factor():
    # fp16 + GradScaler: the incoming gradient carries the loss scale (2**12 here: the largest gradient stays in
    # fp16's range) and a tiny unscaled loss (2**-14: its gradient alone would be subnormal in fp16); the row
    # gradient is scaled in fp32 and rounded to fp16 once
    hidden, weight, b, target = make_inputs(37, 19, 150, torch.float16, True)
    d = torch.randn(37, generator=torch.Generator().manual_seed(3)) * 2**-14 * 2**12
    _, dh = frozen_run(hidden, weight, b, target, d, None, entropy=True)
    _, ref = frozen_run(hidden, weight, b, target, d.double(), None,
                        fn=lambda h, w, t, bias, **k: fp64_outputs(h, w, t, bias, 1.0, 1.0, None))
    assert dh.dtype == torch.float16 and torch.isfinite(dh).all() and relative_error(dh, ref) < 2e-3
