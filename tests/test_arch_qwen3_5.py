"""Qwen3.5 hybrids beyond the architecture matrix (tests/test_architectures.py): the casts of the zero-centred
and the gated RMSNorm against transformers' modules (bf16 bit for bit on foak's references; the Triton kernels
in the interpreter), RoPE under multimodal (3-axis, interleaved mrope) position ids, the 4-row position ids
of the multimodal generation path, and what packed batches do in the linear-attention layers."""

from __future__ import annotations

import copy

import pytest
import torch

import foak
from foak.patching import moe as moe_patching
from foak.patching import replacements
from foak.patching.packed_attention import packed_attention_counts
from foak.testing import relative_error

from test_architectures import batch_of, build, loss_and_grads

_PATCHED = []


@pytest.fixture(autouse=True)
def _restore():
    yield
    foak.set_backend("auto")
    while _PATCHED:
        foak.restore(_PATCHED.pop())


def patch(model, backend="reference", **switches):
    foak.set_backend(backend)
    _PATCHED.append(model)
    return foak.patch(model, **switches)


def assert_grads_close(model, ref, tol, what):
    compared = 0
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        if p.grad is None and r.grad is None:
            continue
        err = relative_error(p.grad, r.grad)
        assert err <= tol, f"{what}: grad of {name}: {err:.3g} > {tol}"
        compared += 1
    assert compared > 0


# ---- the norms' casts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_and_gated_norms_are_hf_bit_for_bit(dtype):
    """foak's references compute HF's casts exactly: (1 + w) in fp32 before the cast (Qwen3_5RMSNorm), and the
    gated norm's llama-style cast before the weight and silu(gate) product in fp32 (Qwen3_5RMSNormGated)."""
    model = build("qwen3_5_text").to(dtype)
    ref = copy.deepcopy(model)
    patch(model)
    g = torch.Generator().manual_seed(3)
    layer, ref_layer = model.model.layers[0], ref.model.layers[0]
    assert "forward" in vars(layer.input_layernorm) and "forward" in vars(layer.linear_attn.norm)  # foak's
    with torch.no_grad():
        for m in (layer.input_layernorm, layer.linear_attn.norm):
            m.weight.copy_(torch.randn(m.weight.shape, generator=g))
        ref_layer.input_layernorm.weight.copy_(layer.input_layernorm.weight)
        ref_layer.linear_attn.norm.weight.copy_(layer.linear_attn.norm.weight)
    x = (3 * torch.randn(5, 64, generator=g)).to(dtype)
    assert torch.equal(layer.input_layernorm(x), ref_layer.input_layernorm(x))
    h, z = (torch.randn(7, 8, generator=g) * 2).to(dtype), torch.randn(7, 8, generator=g).to(dtype)
    assert torch.equal(layer.linear_attn.norm(h, z), ref_layer.linear_attn.norm(h, z))


def test_gated_norm_mixed_dtypes_and_its_forward_ran():
    """Under autocast over fp32 weights the gated norm's input is bf16 and its weight fp32: HF's product is fp32
    (cast to bf16 at the end); foak's rule takes the torch product there (glu needs one dtype), still exactly."""
    model = build("qwen3_5_text")
    ref = copy.deepcopy(model)
    patch(model)
    norm, ref_norm = model.model.layers[0].linear_attn.norm, ref.model.layers[0].linear_attn.norm
    assert "forward" in vars(norm) and "forward" not in vars(ref_norm)
    g = torch.Generator().manual_seed(4)
    h = torch.randn(6, 8, generator=g).bfloat16()
    z = torch.randn(6, 8, generator=g).bfloat16()
    out, expected = norm(h, z), ref_norm(h, z)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_on_the_triton_kernels(dtype):
    """The same modules on foak's Triton kernels (the interpreter here): forward and backward, odd rows."""
    model = build("qwen3_5_text").to(dtype)
    ref = copy.deepcopy(model)
    report = patch(model, backend="auto")
    assert "triton" in report.result("qwen3_5_text.rms_norm_gated").backend, str(report)
    g = torch.Generator().manual_seed(5)
    layer, ref_layer = model.model.layers[0], ref.model.layers[0]
    with torch.no_grad():
        w = torch.randn(8, generator=g).to(dtype)
        layer.linear_attn.norm.weight.copy_(w)
        ref_layer.linear_attn.norm.weight.copy_(w)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    x = (2 * torch.randn(5, 64, generator=g)).to(dtype)
    h, z = torch.randn(7, 8, generator=g).to(dtype), torch.randn(7, 8, generator=g).to(dtype)
    for mod, ref_mod, args in ((layer.input_layernorm, ref_layer.input_layernorm, (x,)),
                               (layer.linear_attn.norm, ref_layer.linear_attn.norm, (h, z))):
        a = [t.clone().requires_grad_() for t in args]
        b = [t.clone().requires_grad_() for t in args]
        out, expected = mod(*a), ref_mod(*b)
        assert relative_error(out, expected) <= tol
        dy = torch.randn(out.shape, generator=g).to(dtype)
        out.backward(dy)
        expected.backward(dy)
        for ta, tb in zip(a, b):
            assert relative_error(ta.grad, tb.grad) <= tol
        assert relative_error(mod.weight.grad, ref_mod.weight.grad) <= tol


# ---- RoPE: partial rotary, multimodal positions ---------------------------------------------------------


def test_rope_is_exact_under_multimodal_position_ids(monkeypatch):
    """3-axis position ids (temporal, height, width differ, as for image tokens): the rotary-embedding module
    (transformers') builds the interleaved mrope cos/sin, foak's rope rotates the first partial_rotary_factor of
    each head with them: loss and every gradient as unpatched."""
    calls = [0]
    rope = replacements.rope

    def counted(*args, **kwargs):
        calls[0] += 1
        return rope(*args, **kwargs)

    monkeypatch.setattr(replacements, "rope", counted)
    model = build("qwen3_5_text")
    assert model.model.rotary_emb.inv_freq.numel() * 2 < model.config.head_dim  # partial rotary
    ref = copy.deepcopy(model)
    patch(model)
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(3, 301, (2, 12), generator=g)
    t = torch.arange(12).expand(2, -1)
    pos = torch.stack([t // 4, t % 4 + 3, (t * 5) % 7])  # [3, B, S]: three different position axes
    batch = {"input_ids": ids, "position_ids": pos, "labels": ids}
    out, _ = loss_and_grads(model, batch)
    ref_out, _ = loss_and_grads(ref, batch)
    assert calls[0] > 0
    assert relative_error(out.loss, ref_out.loss) <= 1e-6
    assert_grads_close(model, ref, 1e-5, "mrope positions")
    # the positions mattered: a text-only batch gives another loss
    with torch.no_grad():
        plain = ref(input_ids=ids, labels=ids).loss
    assert abs(plain.item() - ref_out.loss.item()) > 1e-4


# ---- packed batches -----------------------------------------------------------------------------------


def test_packed_batch_linear_attention_layers_mix_sequences_as_unpatched():
    """transformers' gated delta net, given position ids alone, runs across packed sequences (its conv and
    recurrent state carry over): the second sequence's logits differ from running it alone, patched and
    unpatched alike, and patched equals unpatched. The report row says so."""
    model = build("qwen3_5_text")
    ref = copy.deepcopy(model)
    report = patch(model)
    assert "carry their state across packed sequences" in report.result("qwen3_5_text.packed_attention").notes
    packed = batch_of("packed")
    ids, pos = packed["input_ids"], packed["position_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        ref_logits = ref(input_ids=ids, position_ids=pos, use_cache=False).logits
        second = ids[:, 5:14]  # the second packed sequence (lengths 5, 9, 3)
        alone = ref(input_ids=second, use_cache=False).logits
    assert relative_error(logits, ref_logits) <= 1e-5
    mixed = relative_error(ref_logits[:, 5:14], alone)
    assert mixed > 1e-3, mixed  # transformers' own result mixes the sequences
    assert relative_error(logits[:, 5:14], alone) > 1e-3
    foak_calls, other = packed_attention_counts(report, "qwen3_5_text.packed_attention")
    assert sum(foak_calls.values()) == 1 and not other  # the full-attention layer ran per sequence


def test_four_row_position_ids_of_the_multimodal_path():
    """The multimodal generation path hands the text model [4, B, S] position ids (text row + 3 mrope rows).
    foak's packed path reads 2-D ids only: such a batch runs transformers' block-causal mask, as unpatched."""
    model = build("qwen3_5_text")
    ref = copy.deepcopy(model)
    report = patch(model)
    packed = batch_of("packed")
    pos = packed["position_ids"].expand(4, 1, -1)
    batch = {**packed, "position_ids": pos}
    out, _ = loss_and_grads(model, batch)
    ref_out, _ = loss_and_grads(ref, batch)
    assert relative_error(out.loss, ref_out.loss) <= 1e-6
    assert_grads_close(model, ref, 1e-5, "4-row position ids")
    foak_calls, other = packed_attention_counts(report, "qwen3_5_text.packed_attention")
    assert not foak_calls and other == {"not a packed batch": 1}


# ---- MoE ------------------------------------------------------------------------------------------------


def test_moe_experts_run_foak_without_fallback():
    model = build("qwen3_5_moe_text")
    report = patch(model)
    loss_and_grads(model, batch_of("padded"))
    calls, other = moe_patching.moe_counts(report, "qwen3_5_moe_text.moe")
    assert calls == 2 and other == {}
    # the shared expert is the swiglu row's MLP; the router stays transformers'
    mlp = model.model.layers[0].mlp
    assert "forward" in vars(mlp.shared_expert) and "forward" not in vars(mlp.gate)
