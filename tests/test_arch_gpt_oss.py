"""gpt-oss beyond the architecture matrix: its RoPE (cos/sin with one value per frequency) through foak's rope
kernel, its RMSNorm's casting (``(weight * x_hat).to(input dtype)``, fp32 weights beside bf16 activations),
which experts modules foak's fast_moe takes (alpha/limit read per call, clamps active; a changed layout flag or
an overridden gate keep transformers' forward, counted or reported with the reason), the packed attention rule
taking the attention with its sinks (tests/test_sink_attention.py checks it), and a bf16 model on the Triton
kernels (interpreter)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.gpt_oss import modeling_gpt_oss as modeling

import foak
from foak.models.tiny import tiny_model
from foak.ops.rms_norm import rms_norm
from foak.patching import replacements
from foak.patching.moe import moe_counts
from foak.testing import relative_error

_PATCHED: list = []


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


def batch(seed=1, shape=(2, 9)):
    ids = torch.randint(3, 301, shape, generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def loss_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_half_cos_sin_through_foak_matches_hf(dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 7, 16, generator=g).to(dtype).requires_grad_()
    k = torch.randn(2, 2, 7, 16, generator=g).to(dtype).requires_grad_()
    theta = torch.rand(2, 7, 8, generator=g) * 6
    cos, sin = theta.cos().to(dtype), theta.sin().to(dtype)
    ours = replacements._foak_apply_rotary_pos_emb(modeling.apply_rotary_pos_emb, half_cos_sin=True)
    wrong = replacements._foak_apply_rotary_pos_emb(modeling.apply_rotary_pos_emb)  # cos/sin taken as partial rotary
    replacements._ROPE_ACTIVE.on = True
    try:
        out = ours(q, k, cos, sin)
        misread = wrong(q, k, cos, sin)
    finally:
        replacements._ROPE_ACTIVE.on = False
    ref = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    dq = torch.linspace(-1, 1, q.numel()).view_as(q).to(dtype)
    dk = torch.linspace(1, -1, k.numel()).view_as(k).to(dtype)
    grads = torch.autograd.grad(out, (q, k), (dq, dk))
    ref_grads = torch.autograd.grad(ref, (q, k), (dq, dk))
    for a, b in zip((*out, *grads), (*ref, *ref_grads)):
        assert a.dtype == b.dtype == dtype
        assert relative_error(a, b) <= tol, relative_error(a, b)
    assert relative_error(misread[0], ref[0]) > 0.1  # the repeat is what makes it the same rotation


def test_rms_norm_casts_like_hf_with_fp32_weight_and_bf16_input():
    norm = modeling.GptOssRMSNorm(40, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(40) * 0.5 + 1)
    x = torch.randn(6, 40).to(torch.bfloat16)
    ref = norm(x)  # transformers keeps the norms in fp32 (_keep_in_fp32_modules) beside bf16 activations
    ours = rms_norm(x, norm.weight, norm.variance_epsilon, "olmo")
    assert ref.dtype == ours.dtype == torch.bfloat16
    assert relative_error(ours, ref) <= 4e-3
    llama = rms_norm(x, norm.weight, norm.variance_epsilon, "llama")  # its casting differs here
    assert llama.dtype == torch.float32


def test_experts_read_alpha_and_limit_per_call_with_active_clamps():
    model = tiny_model("gpt_oss")
    for layer in model.model.layers:  # transformers initialises the expert weights small: clamps need a small limit
        layer.mlp.experts.limit, layer.mlp.experts.alpha = 0.02, 1.3
        with torch.no_grad():
            layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.02)
            layer.mlp.experts.down_proj_bias.normal_(0, 0.02)
    ref = copy.deepcopy(model)
    report = patch(model)
    inputs = batch()
    loss, grads = loss_and_grads(model, inputs)
    ref_loss, ref_grads = loss_and_grads(ref, inputs)
    assert relative_error(loss, ref_loss) <= 1e-5
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert relative_error(g, ref_grads[name]) <= 1e-5, name
    assert moe_counts(report, "gpt_oss.moe") == (2, {})
    experts = model.model.layers[0].mlp.experts
    h = model.model.layers[0].post_attention_layernorm(torch.randn(5, 64)) @ experts.gate_up_proj[0]
    assert (h[:, 0::2] > experts.limit).any() and (h[:, 1::2].abs() > experts.limit).any()


def test_experts_with_another_layout_flag_run_transformers_forward_counted():
    model = tiny_model("gpt_oss")
    ref = copy.deepcopy(model)
    report = patch(model)
    for m in (model, ref):  # transformers' grouped_mm/batched_mm forwards then leave the biases out; foak declines
        m.model.layers[1].mlp.experts.has_bias = False
    inputs = batch()
    loss, grads = loss_and_grads(model, inputs)
    ref_loss, ref_grads = loss_and_grads(ref, inputs)
    assert relative_error(loss, ref_loss) <= 1e-5
    for name, g in grads.items():
        assert relative_error(g, ref_grads[name]) <= 1e-5, name
    why = "has_bias=False with GptOssExperts's own gate (it assumes True)"
    assert moe_counts(report, "gpt_oss.moe") == (1, {why: 1})
    assert why in str(report)


def test_overridden_gate_is_not_patched():
    class OtherGate(modeling.GptOssExperts):
        def _apply_gate(self, gate_up):
            return super()._apply_gate(gate_up) * 2

    model = tiny_model("gpt_oss")
    for layer in model.model.layers:
        layer.mlp.experts.__class__ = OtherGate
    report = patch(model)
    row = next(r for r in report.results if r.rule_id == "gpt_oss.moe")
    # not registered: the default layout checks decline it (its gate/up columns are interleaved)
    assert row.modules == 0 and "2 OtherGate modules not patched: interleaved gate/up" in row.note, str(report)


def test_packed_attention_takes_the_attention_with_its_sinks():
    model = tiny_model("gpt_oss")
    report = patch(model)
    row = next(r for r in report.results if r.rule_id == "gpt_oss.packed_attention")
    assert row.modules == 1, str(report)
    assert model.config._attn_implementation == "foak"  # switched from eager to foak's


def test_bf16_model_on_the_kernels():
    model = tiny_model("gpt_oss").to(torch.bfloat16)
    for name, m in model.named_modules():  # as transformers loads it: the norms kept in fp32
        if isinstance(m, modeling.GptOssRMSNorm):
            m.float()
    ref = copy.deepcopy(model)
    patch(model, backend="auto")
    inputs = batch(shape=(1, 12))
    loss, grads = loss_and_grads(model, inputs)
    ref_loss, ref_grads = loss_and_grads(ref, inputs)
    assert relative_error(loss, ref_loss) <= 1e-2
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj_bias",
                 "model.layers.1.mlp.experts.gate_up_proj_bias", "model.layers.0.input_layernorm.weight"):
        assert grads[name].dtype == ref_grads[name].dtype
        err = relative_error(grads[name], ref_grads[name])
        assert err <= 5e-2, (name, err)
