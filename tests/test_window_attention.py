"""fast_packed_attention on UNPACKED batches of models with sliding-window layers (foak.patching.packed_attention,
_WindowBatch): with no attention mask, or a left- or right-padding mask, the sliding-window layers run foak's
varlen attention with the window (per-sequence SDPA here on the CPU) and transformers builds no
sliding-window mask for them; full-attention layers keep transformers' mask and implementation.

Checks: tiny Mistral (sliding_window=4 < the 11-token rows) patched vs unpatched, loss and every gradient within
1e-5 (fp32) on unpadded, left-padded and right-padded batches, with and without gradient checkpointing
(reentrant and not: a recomputed layer finds its batch again); the report counts the windowed calls; the mask
function passed no sliding-window mask request on to transformers' mask builder (intercepted); padded positions'
outputs are finite. A Qwen2 with layer_types [full, sliding, full]: the full layers run transformers' sdpa with
its mask (counted, their mask built, the first full layer's output bit-identical). Calls the path declines
(output_attentions; sinks the attention function is not given; left padding under eager; padding with gaps) run
transformers' mask and implementation, counted with their reasons, and compute what the unpatched model does.
Op level: unpadded_sequences against the mask it reads.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

import foak
from foak.ops import varlen_attention as va
from foak.patching.packed_attention import packed_attention_counts, window_attention_counts
from foak.testing import relative_error

VOCAB = 61
S = 11
WINDOW = 4
_COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
           "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
MIXED = ["full_attention", "sliding_attention", "full_attention"]


def build(kind: str = "mistral", attn: str = "sdpa", seed: int = 0, window: int = WINDOW) -> nn.Module:
    if kind == "mistral":
        config = transformers.MistralConfig(**_COMMON, sliding_window=window)
    else:  # Qwen2 with full and sliding-window layers
        config = transformers.Qwen2Config(**{**_COMMON, "num_hidden_layers": len(MIXED)}, use_sliding_window=True,
                                          sliding_window=WINDOW, layer_types=MIXED)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    model.config.use_cache = False
    return model


def batch_of(kind: str) -> dict:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, VOCAB, (2, S), generator=g)
    mask = torch.ones_like(ids)
    if kind == "unpadded":
        return {"input_ids": ids, "labels": ids.clone()}
    if kind == "left":
        mask[0, :1] = 0
        mask[1, :5] = 0
    elif kind == "right":
        mask[0, -2:] = 0
        mask[1, -6:] = 0
    elif kind == "gap":
        mask[0, 4] = 0
    ids = ids.masked_fill(mask == 0, 2)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def run(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out, grads


def assert_same(got, ref, what, tol=1e-5):
    (out, grads), (ref_out, ref_grads) = got, ref
    err = relative_error(out.loss.detach(), ref_out.loss.detach())
    assert err <= tol, f"{what}: loss relative error {err:.3g}"
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in ref_grads.items():
        err = relative_error(grads[name], g)
        assert err <= tol, f"{what}: grad of {name}: relative error {err:.3g}"


@pytest.fixture
def mask_requests(monkeypatch):
    """The local_size (None: a full-attention mask) of every request that reached transformers' sdpa/eager mask
    builders."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    seen = []
    for name in ("sdpa", "eager"):
        builder = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[name]

        def recording(*args, _builder=builder, **kwargs):
            seen.append(kwargs.get("local_size"))
            return _builder(*args, **kwargs)

        monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, name, recording)
    return seen


# ---- Mistral: every layer a sliding-window layer --------------------------------------------------------


@pytest.mark.parametrize(("kind", "checkpointing"), [
    ("unpadded", None), ("left", None), ("right", None), ("left", False), ("right", True)],
    ids=["unpadded", "left", "right", "left-checkpoint", "right-checkpoint-reentrant"])
def test_sliding_window_layers_of_unpacked_batches_match_transformers(kind, checkpointing, mask_requests):
    model = build()
    reference = copy.deepcopy(model)
    if checkpointing is not None:
        for m in (model, reference):
            m.gradient_checkpointing_enable({"use_reentrant": checkpointing})
            m.train()
    report = foak.patch(model, fast_packed_attention=True)
    batch = batch_of(kind)
    ref = run(reference, batch)
    mask_requests.clear()
    got = run(model, batch)
    assert_same(got, ref, kind)
    assert torch.isfinite(got[0].logits).all()
    assert mask_requests == []  # no sliding-window mask (nor any other) was built for the patched model
    layers = model.config.num_hidden_layers
    calls = layers if checkpointing is None else 2 * layers  # a recomputed layer's call is counted too
    assert window_attention_counts(report, "mistral.packed_attention") == {"sdpa": calls}
    assert packed_attention_counts(report, "mistral.packed_attention") == ({}, {})
    row = report.result("mistral.packed_attention")
    assert f"sliding-window layers of unpacked batches: foak varlen attention ran {calls} calls (sdpa {calls})" \
        in row.notes


@pytest.mark.parametrize("kind", ["unpadded", "left"])
def test_a_window_longer_than_the_rows_takes_the_same_path(kind, mask_requests):
    """Plain causal attention then: transformers skips its mask for an unpadded batch (SDPA is_causal) and
    builds a padding mask for a padded one; foak's windowed path runs either way and builds none."""
    model = build(window=S + 5)
    reference = copy.deepcopy(model)
    report = foak.patch(model, fast_packed_attention=True)
    batch = batch_of(kind)
    ref = run(reference, batch)
    mask_requests.clear()
    assert_same(run(model, batch), ref, kind)
    assert mask_requests == []
    assert window_attention_counts(report, "mistral.packed_attention") == {"sdpa": 2}


def test_a_padded_batch_attends_only_within_the_window_of_its_own_tokens():
    """The windowed path really cuts: the output of a token does not depend on a token WINDOW or more before it,
    nor on the padding; it does depend on the one WINDOW - 1 before it."""
    model = build()
    foak.patch(model, fast_packed_attention=True)
    model.model.layers = model.model.layers[:1]  # one layer: the receptive field is the window itself
    batch = batch_of("left")
    ids, mask = batch["input_ids"], batch["attention_mask"]

    def logits(changed_at):
        x = ids.clone()
        x[1, changed_at] = (x[1, changed_at] + 7) % (VOCAB - 3) + 3
        return model(input_ids=x, attention_mask=mask).logits[1, -1]

    base = model(input_ids=ids, attention_mask=mask).logits[1, -1]
    assert torch.equal(logits(S - 1 - WINDOW), base)  # outside the window
    assert torch.equal(logits(2), base)  # a padded position
    assert not torch.equal(logits(S - WINDOW), base)  # the oldest token inside the window


# ---- full and sliding-window layers ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["unpadded", "left", "right"])
def test_full_attention_layers_keep_transformers_mask_and_implementation(kind, mask_requests):
    model = build("qwen2")
    assert model.config.layer_types == MIXED
    reference = copy.deepcopy(model)
    report = foak.patch(model, fast_packed_attention=True)
    batch = batch_of(kind)
    ref = run(reference, batch)
    mask_requests.clear()
    got = run(model, batch)
    assert_same(got, ref, kind)
    # transformers was asked for the full-attention mask only, never for the sliding-window one
    assert mask_requests == [None]
    assert window_attention_counts(report, "qwen2.packed_attention") == {"sdpa": 1}
    assert packed_attention_counts(report, "qwen2.packed_attention") == ({}, {"not a packed batch": 2})
    # the first (full-attention) layer computes exactly what transformers' does
    with torch.no_grad():
        hidden = model(**batch, output_hidden_states=True).hidden_states[1]
        ref_hidden = reference(**batch, output_hidden_states=True).hidden_states[1]
    assert torch.equal(hidden, ref_hidden)


# ---- calls the windowed path declines ----------------------------------------------------------------------


def test_output_attentions_builds_the_window_mask_after_all_and_runs_the_previous_implementation():
    model = build(attn="eager")
    reference = copy.deepcopy(model)
    report = foak.patch(model, fast_packed_attention=True)
    batch = batch_of("right")
    out = model(**batch, output_attentions=True)
    ref = reference(**batch, output_attentions=True)
    assert torch.equal(out.logits, ref.logits)
    assert len(out.attentions) == 2 and all(torch.equal(a, b) for a, b in zip(out.attentions, ref.attentions))
    assert packed_attention_counts(report, "mistral.packed_attention") == ({}, {"output_attentions": 2})
    assert window_attention_counts(report, "mistral.packed_attention") == {}


@pytest.mark.parametrize(("what", "attn", "kind", "reason"), [
    ("sinks", "sdpa", "right", "attention sinks not passed to the attention function (s_aux)"),
    ("eager", "eager", "left", "left padding under eager attention"),
    ("gap", "sdpa", "gap", "a padding mask that is not left or right padding"),
])
def test_batches_the_window_path_declines_are_bit_identical_to_transformers(what, attn, kind, reason, mask_requests):
    model = build(attn=attn)
    if what == "sinks":  # a sinks tensor Mistral's attention does not pass on (gpt-oss's passes s_aux)
        for layer in model.model.layers:
            layer.self_attn.register_buffer("sinks", torch.zeros(4))
    reference = copy.deepcopy(model)
    report = foak.patch(model, fast_packed_attention=True)
    batch = batch_of(kind)
    (out, grads), (ref_out, ref_grads) = run(model, batch), run(reference, batch)
    assert torch.equal(out.logits, ref_out.logits)
    assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
    assert packed_attention_counts(report, "mistral.packed_attention") == ({}, {reason: 2})
    assert window_attention_counts(report, "mistral.packed_attention") == {}


def test_eager_right_padding_takes_the_window_path():
    model = build(attn="eager")
    reference = copy.deepcopy(model)
    report = foak.patch(model, fast_packed_attention=True)
    batch = batch_of("right")
    assert_same(run(model, batch), run(reference, batch), "eager right")
    assert window_attention_counts(report, "mistral.packed_attention") == {"sdpa": 2}


def test_kv_cache_prefill_takes_the_window_path_and_decoding_keeps_transformers_mask():
    model = build()
    reference = copy.deepcopy(model)
    report = foak.patch(model, fast_packed_attention=True)
    batch = batch_of("left")
    mask = batch["attention_mask"]
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=mask, use_cache=True)
        ref = reference(input_ids=batch["input_ids"], attention_mask=mask, use_cache=True)
        assert relative_error(out.logits, ref.logits) <= 1e-5
        nxt = torch.tensor([[5], [6]])
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        step = model(input_ids=nxt, attention_mask=mask, past_key_values=out.past_key_values, use_cache=True)
        ref_step = reference(input_ids=nxt, attention_mask=mask, past_key_values=ref.past_key_values, use_cache=True)
    assert relative_error(step.logits, ref_step.logits) <= 1e-5
    assert window_attention_counts(report, "mistral.packed_attention") == {"sdpa": 2}
    assert packed_attention_counts(report, "mistral.packed_attention") == ({}, {"a KV cache holding earlier tokens": 2})


# ---- op level ------------------------------------------------------------------------------------------------


def test_unpadded_sequences_reads_left_and_right_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    seqs, index = va.unpadded_sequences(mask)
    assert seqs.lengths == (3, 3, 5) and seqs.cu_seqlens.tolist() == [0, 3, 6, 11]
    assert index.tolist() == [2, 3, 4, 5, 6, 7, 15, 16, 17, 18, 19]
    seqs, index = va.unpadded_sequences(torch.ones(2, 4, dtype=torch.bool))
    assert index is None and seqs.lengths == (4, 4) and seqs.total == 8
    assert va.unpadded_sequences(torch.tensor([[1, 0, 1]])) is None  # a gap inside a row
    assert va.unpadded_sequences(torch.zeros(2, 3)) is None  # no token at all
    with pytest.raises(ValueError, match="padding_mask must be a tensor"):
        va.unpadded_sequences(torch.ones(3))


def test_gathered_window_attention_matches_explicit_math():
    """The windowed path's op call on a padded batch: gathered tokens, varlen with the window, against fp64 math
    on each row's tokens alone."""
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 0, 0]])
    B, L = mask.shape
    seqs, index = va.unpadded_sequences(mask)
    q, k, v = (torch.randn(B * L, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    out = va.varlen_attention(*(t.index_select(0, index) for t in (q, k, v)), seqs, window=3, backend="sdpa")
    for r, (start, n) in enumerate(((3, 6), (0, 7))):
        rows = slice(r * L + start, r * L + start + n)
        one = va.sequences_from_lengths([n])
        ref = va.varlen_attention_reference(q[rows], k[rows], v[rows], one, window=3)
        got = out[sum(seqs.lengths[:r]):sum(seqs.lengths[:r + 1])]
        assert relative_error(got, ref) <= 1e-12
