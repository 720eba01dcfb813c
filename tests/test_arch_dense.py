"""Dense decoders beyond the matrix (tests/test_architectures.py): what only these architectures do.

- GLM-4's interleaved RoPE (partial rotary) through foak's rope op = transformers' own glm4 function;
  Phi-3's partial rotary likewise (rotate_half layout).
- OLMo 2/3's RMSNorm (``(weight * normalised).to(dtype)``): in bf16 the patched norms equal HF's bit for bit
  (the matrix runs fp32, where foak's "llama" mode would be equal too).
- SmolLM3's NoPE layer runs no RoPE: one rope call per forward for the one rotary layer.
- Phi-3's fused gate_up_proj under PEFT LoRA: the fused LoRA GLU block ran; with LoRA on gate_up_proj only,
  the MLP still equals PEFT's.
"""

from __future__ import annotations

import copy

import pytest
import torch

import foak
from foak.models.tiny import tiny_model
from foak.ops.rope import rope
from foak.patching import replacements
from foak.testing import relative_error


@pytest.fixture
def patched():
    models = []
    yield models
    foak.set_backend("auto")
    for m in models:
        foak.restore(m)


def _qk_cos_sin(dtype, rot, head_dim=16, seq=7):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, seq, 4, head_dim, generator=g).transpose(1, 2).to(dtype)  # [B, H, S, D] as HF makes it
    k = torch.randn(2, seq, 2, head_dim, generator=g).transpose(1, 2).to(dtype)
    freqs = torch.rand(2, seq, rot // 2, generator=g) * 6.3
    emb = torch.cat((freqs, freqs), dim=-1)  # what the rotary embedding modules return
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch, interleaved", [("glm4", True), ("phi3", False)])
def test_rope_matches_the_modeling_function(arch, interleaved, dtype):
    import importlib

    modeling = importlib.import_module(f"transformers.models.{arch}.modeling_{arch}")
    q, k, cos, sin = _qk_cos_sin(dtype, rot=8)  # partial rotary: 8 of 16 dims
    qr, kr = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    qf, kf = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    ref = modeling.apply_rotary_pos_emb(qr, kr, cos, sin)
    out = rope(qf, kf, cos, sin, interleaved=interleaved)
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # HF rounds each bf16 product, foak once
    dq = torch.randn(q.shape, dtype=dtype)
    dk = torch.randn(k.shape, dtype=dtype)
    torch.autograd.backward(ref, (dq, dk))
    torch.autograd.backward(out, (dq, dk))
    for o, r in ((out[0], ref[0]), (out[1], ref[1]), (qf.grad, qr.grad), (kf.grad, kr.grad)):
        assert relative_error(o, r) < tol
    assert torch.equal(out[0][..., 8:], q[..., 8:])  # the pass-through dims are untouched
    # the other layout is a different function: the test tells them apart
    assert relative_error(rope(q, k, cos, sin, interleaved=not interleaved)[0], ref[0]) > 0.1


@pytest.mark.parametrize("arch", ["olmo2", "olmo3"])
def test_olmo_norms_equal_hf_in_bf16(arch, patched):
    model = tiny_model(arch).to(torch.bfloat16)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) == 9  # post-attention, post-feedforward, q_norm, k_norm per layer; the final norm
    with torch.no_grad():
        for m in norms:
            m.weight.copy_(torch.rand(m.weight.shape) * 2 + 0.1)
    g = torch.Generator().manual_seed(3)
    inputs = [torch.randn(3, 5, m.weight.shape[0], generator=g).to(torch.bfloat16) for m in norms]
    expected = [m(x) for m, x in zip(norms, inputs)]
    llama_mode = [m.weight * foak.ops.rms_norm.rms_norm_reference(x, torch.ones_like(m.weight), m.variance_epsilon)
                  for m, x in zip(norms, inputs)]
    patched.append(model)
    report = foak.patch(model)
    assert report.count(f"{arch}.rms_norm") == 9
    for m, x, e, wrong in zip(norms, inputs, expected, llama_mode):
        y = m(x)
        assert y.dtype == e.dtype == torch.bfloat16
        assert torch.equal(y, e)
        assert not torch.equal(wrong, e)  # rounding before the product ("llama") would differ


def test_smollm3_nope_layer_runs_no_rope(patched, monkeypatch):
    model = tiny_model("smollm3")
    assert [a.self_attn.use_rope for a in model.model.layers] == [1, 0]
    foak.set_backend("reference")
    patched.append(model)
    report = foak.patch(model)
    row = report.result("smollm3.rope")
    assert row.modules == 1 and "1 SmolLM3Attention module not patched: a NoPE layer" in row.note
    calls = [0]
    op = replacements.rope

    def counted(*args, **kwargs):
        calls[0] += 1
        return op(*args, **kwargs)

    monkeypatch.setattr(replacements, "rope", counted)
    model(input_ids=torch.randint(3, 300, (1, 9)))
    assert calls[0] == 1


@pytest.mark.parametrize("targets, fused_calls", [("all-linear", 8), (["gate_up_proj"], 2)])
def test_phi3_fused_gate_up_under_lora(targets, fused_calls, patched):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model("phi3"), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False))
    ref = copy.deepcopy(model)
    foak.set_backend("reference")
    patched.append(model)
    report = foak.patch(model)
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(5))
    out, ref_out = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    out.loss.backward()
    ref_out.loss.backward()
    assert relative_error(out.loss, ref_out.loss) < 1e-6
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert relative_error(p.grad, ref_grads[name].grad) < 1e-5, name
    assert f"fused {fused_calls} calls" in report.result("phi3.fused_lora").notes
    mlp_note = report.result("phi3.swiglu").notes
    if targets == "all-linear":  # down_proj a LoRA layer: the fused LoRA GLU block
        assert "2 forwards as fused LoRA MLP blocks" in mlp_note
    else:  # down_proj a plain Linear: foak's glu_linear after the fused gate_up LoRA call
        assert "LoRA MLP blocks" not in mlp_note


def test_foak_train_default_lora_targets_follow_fused_projections():
    from foak.train import DEFAULT_TARGETS, default_targets

    names = lambda model: {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert default_targets(names(tiny_model("phi3"))) == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert default_targets(names(tiny_model("glm4"))) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj",
                                                          "down_proj"]
    assert default_targets(names(tiny_model("olmo2"))) == DEFAULT_TARGETS


@pytest.mark.parametrize("arch", ["olmo2", "olmo3"])
def test_olmo_rope_keeps_q_dtype_in_bf16(arch, patched):
    # OLMo's rotary embedding keeps cos/sin in fp32 and its apply_rotary_pos_emb casts q, k back to their own
    # dtype: in a bf16 model a promoted (fp32) q next to a bf16 v would break the attention
    model = tiny_model(arch).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    foak.set_backend("reference")
    patched.append(model)
    foak.patch(model)
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(6))
    loss, ref_loss = model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss
    loss.backward()
    ref_loss.backward()
    assert relative_error(loss, ref_loss) < 1e-2
    g, rg = model.model.layers[0].self_attn.q_norm.weight.grad, ref.model.layers[0].self_attn.q_norm.weight.grad
    assert relative_error(g, rg) < 5e-2
