"""Attention sinks (gpt-oss) through foak's varlen attention (foak.patching.packed_attention with
foak.ops.varlen_attention's ``sinks``): a tiny gpt-oss (a sliding-window layer with window 4, shorter than the
batches, and a full-attention layer; sink logits drawn large enough to take real probability), fp32, foak's
reference backend, patched vs unpatched (transformers' eager attention with its sinks): loss and every gradient,
the sinks' included, within 1e-5 on unpadded, left-/right-padded (with and without gradient checkpointing)
batches, and on packed batches against each sequence run alone (transformers' gpt-oss lets packed sequences
see each other). Every attention call runs foak's varlen attention with the sinks (the op's calls counted), no
mask is built for an unpadded/padded batch, the report row counts the calls with sinks; calls the path
declines (output_attentions) run transformers' mask and eager attention, counted with the reason; while
compiling, transformers' masks and eager; foak verify's packed reference keeps gpt-oss's sequences apart. The
op's own tests (CPU flash per sequence, the CUDA flash glue with the kernel emulated, vs fp64 softmax over
[scores, sink]) are in tests/test_packing.py.
"""
from __future__ import annotations

import copy

import pytest
import torch

import foak
from foak.models.tiny import tiny_model
from foak.ops import varlen_attention as va
from foak.patching import packed_attention as pa
from foak.testing import relative_error

RULE = "gpt_oss.packed_attention"
S = 11


@pytest.fixture(autouse=True)
def _reference_backend():
    foak.set_backend("reference")
    yield
    foak.set_backend("auto")


def build(seed=0):
    model = tiny_model("gpt_oss", seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:  # transformers draws them with std 0.02: make the sink matter
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=g) * 1.5)
    model.config.use_cache = False
    return model


def batch_of(kind):
    g = torch.Generator().manual_seed(7)
    vocab = 301
    ids = torch.randint(3, vocab, (2, S), generator=g)
    if kind == "unpadded":
        return {"input_ids": ids, "labels": ids.clone()}
    if kind == "packed":  # 3 + 5 + 3 tokens in row 0, 6 + 5 in row 1
        pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]])
        labels = ids.clone()
        labels[pos == 0] = -100
        return {"input_ids": ids, "position_ids": pos, "labels": labels}
    mask = torch.ones_like(ids)
    if kind == "left":
        mask[0, :1] = 0
        mask[1, :5] = 0
    else:  # right
        mask[0, -2:] = 0
        mask[1, -6:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def run(model, batch, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(**batch, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, grads


def run_alone(model, packed):
    """Each sequence of a packed batch alone through ``model`` (transformers' gpt-oss does not look for packed
    sequences: its masks are built without the position ids), the losses combined as the packed batch's mean
    over its labelled tokens; (output with that loss, gradients)."""
    model.zero_grad(set_to_none=True)
    total, count = 0.0, 0
    for row, pos in enumerate(packed["position_ids"]):
        starts = (pos == 0).nonzero().flatten().tolist() + [pos.shape[0]]
        for a, b in zip(starts[:-1], starts[1:]):
            out = model(input_ids=packed["input_ids"][row:row + 1, a:b], labels=packed["labels"][row:row + 1, a:b])
            total = total + out.loss * (b - a - 1)
            count += b - a - 1
    loss = total / count
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    out.loss = loss
    return out, grads


def assert_same(got, ref, what, tol=1e-5):
    (out, grads), (ref_out, ref_grads) = got, ref
    err = relative_error(out.loss.detach(), ref_out.loss.detach())
    assert err <= tol, f"{what}: loss relative error {err:.3g}"
    assert grads.keys() == ref_grads.keys()
    sinks = [n for n in grads if n.endswith("self_attn.sinks")]
    assert len(sinks) == 2 and all(grads[n].abs().max() > 1e-4 for n in sinks), "the sinks get gradients"
    for name, g in ref_grads.items():
        err = relative_error(grads[name], g)
        assert err <= tol, f"{what}: grad of {name}: relative error {err:.3g}"


@pytest.fixture
def op_calls(monkeypatch):
    """(window, sinks given) of every varlen_attention call from the packed-attention rule."""
    seen = []
    real = va.varlen_attention

    def counting(*args, **kwargs):
        seen.append((kwargs.get("window"), kwargs.get("sinks") is not None))
        return real(*args, **kwargs)

    monkeypatch.setattr(pa._varlen, "varlen_attention", counting)
    return seen


@pytest.fixture
def mask_requests(monkeypatch):
    """local_size of every request that reached transformers' eager mask builder."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    seen = []
    builder = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["eager"]

    def recording(*args, **kwargs):
        seen.append(kwargs.get("local_size"))
        return builder(*args, **kwargs)

    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, "eager", recording)
    return seen


@pytest.mark.parametrize(("kind", "checkpointing"), [
    ("unpadded", None), ("left", None), ("right", None), ("left", False), ("right", True), ("packed", None),
    ("packed", False)],
    ids=["unpadded", "left", "right", "left-checkpoint", "right-checkpoint-reentrant", "packed", "packed-checkpoint"])
def test_every_layer_runs_varlen_attention_with_sinks_and_matches_transformers(kind, checkpointing, op_calls,
                                                                               mask_requests):
    model = build()
    if kind == "packed":  # the load-balancing loss mixes the sequences' tokens: off for the per-sequence reference
        model.config.output_router_logits = False
    reference = copy.deepcopy(model)
    if checkpointing is not None:
        for m in (model, reference):
            m.gradient_checkpointing_enable({"use_reentrant": checkpointing})
            m.train()
    report = foak.patch(model)
    assert model.config._attn_implementation == "foak" and reference.config._attn_implementation == "eager"
    batch = batch_of(kind)
    ref = run(reference, batch) if kind != "packed" else run_alone(reference, batch)
    mask_requests.clear()
    got = run(model, batch)
    assert_same(got, ref, kind)
    assert mask_requests == []  # neither the sliding-window nor the causal mask was built
    calls = 1 if checkpointing is None else 2  # per layer; a recomputed layer's call is counted too
    assert op_calls == [(4, True)] * calls + [(None, True)] * calls if checkpointing is None else \
        sorted(op_calls, key=str) == sorted([(4, True)] * calls + [(None, True)] * calls, key=str)
    packed, other = pa.packed_attention_counts(report, RULE)
    sinks, full = pa.sink_attention_counts(report, RULE)
    assert other == {} and sinks == 2 * calls
    row = report.result(RULE)
    assert row.modules == 1 and f"{2 * calls} calls with attention sinks" in row.notes
    if kind == "packed":
        assert packed == {"sdpa": 2 * calls} and full == {} and pa.window_attention_counts(report, RULE) == {}
    else:
        assert packed == {} and full == {"sdpa": calls} and pa.window_attention_counts(report, RULE) == {"sdpa": calls}
        assert f"full-attention layers of unpacked batches: foak varlen attention ran {_calls(calls)}" in row.notes


def _calls(n):
    return "1 call" if n == 1 else f"{n} calls"


def test_packed_sequences_do_not_see_each_other():
    # a packed row's logits equal its sequences' run alone through the unpatched model
    model = build()
    reference = copy.deepcopy(model)
    foak.patch(model)
    packed = batch_of("packed")
    out = model(**{k: v for k, v in packed.items() if k != "labels"})
    starts = [0, 3, 8, 11]
    for a, b in zip(starts[:-1], starts[1:]):
        alone = reference(input_ids=packed["input_ids"][:1, a:b])
        assert relative_error(out.logits[0, a:b], alone.logits[0]) <= 1e-5, (a, b)


def test_output_attentions_runs_transformers_eager_with_its_masks():
    model = build()
    reference = copy.deepcopy(model)
    report = foak.patch(model)
    batch = {k: v for k, v in batch_of("right").items() if k != "labels"}
    out = model(**batch, output_attentions=True)
    ref = reference(**batch, output_attentions=True)
    assert torch.equal(out.logits, ref.logits)
    assert len(out.attentions) == 2 and all(torch.equal(a, b) for a, b in zip(out.attentions, ref.attentions))
    assert pa.packed_attention_counts(report, RULE) == ({}, {"output_attentions": 2})
    assert pa.sink_attention_counts(report, RULE) == (0, {})


def test_verify_reference_of_a_packed_batch_keeps_gpt_oss_sequences_apart():
    # foak verify's unpatched reference on a packed batch: transformers' gpt-oss builds its masks without the
    # position ids (its sequences then see each other); _masks_see_packing passes them to the mask builders
    from foak.verify import _masks_see_packing

    model = build()
    packed = {k: v for k, v in batch_of("packed").items() if k != "labels"}
    leaky = model(**packed).logits
    with _masks_see_packing(model, packed):
        kept = model(**packed).logits
    alone = model(input_ids=packed["input_ids"][:1, 3:8]).logits
    assert relative_error(kept[0, 3:8], alone[0]) <= 1e-5 < relative_error(leaky[0, 3:8], alone[0])
    from transformers.masking_utils import create_causal_mask
    from transformers.models.gpt_oss import modeling_gpt_oss

    assert modeling_gpt_oss.create_causal_mask is create_causal_mask  # put back


def test_while_compiling_a_model_with_sinks_keeps_transformers_masks_and_eager(monkeypatch, op_calls):
    # the op that reads the position ids at run time (the compiled packed path) takes no sinks: while tracing,
    # the stack's forward leaves packed and unpacked batches to transformers (as the unpatched model computes)
    model = build()
    reference = copy.deepcopy(model)
    foak.patch(model)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for kind in ("packed", "unpadded"):
        batch = {k: v for k, v in batch_of(kind).items() if k != "labels"}
        with torch.no_grad():
            assert torch.equal(model(**batch).logits, reference(**batch).logits), kind
    assert op_calls == []


def test_on_cuda_the_sinks_path_waits_for_its_gpu_check(monkeypatch):
    # no GPU here: a batch whose source tensor says it is on CUDA takes the gate (transformers' masks and eager,
    # the forward counted in the row), unless FOAK_CUDA_SINKS=1
    from foak.patching import packed_attention as pa

    monkeypatch.delenv(pa.CUDA_SINKS_ENV, raising=False)
    model = tiny_model("gpt_oss").float()
    ref = copy.deepcopy(model)
    report = foak.patch(model, fast_packed_attention=True)
    ids = torch.randint(3, model.config.vocab_size, (2, 11))
    real_is_cuda = torch.Tensor.is_cuda
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: t is ids or real_is_cuda.__get__(t)))
    got = model(input_ids=ids).logits
    monkeypatch.setattr(torch.Tensor, "is_cuda", real_is_cuda)
    assert torch.equal(got, ref(input_ids=ids).logits)  # transformers' own attention
    notes = report.result("gpt_oss.packed_attention").notes
    assert "1 forward on CUDA kept transformers' attention" in notes and "FOAK_CUDA_SINKS=1 runs it" in notes
    assert pa.sink_attention_counts(report, "gpt_oss.packed_attention")[0] == 0
