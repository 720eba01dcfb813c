"""MoE architectures beyond the matrix (tests/test_architectures.py: qwen2_moe, glm4_moe, glm4_moe_lite, deepseek_v3,
granitemoeshared, llama4_text):

- each MoE row's call counts: foak's ``moe_experts`` ran in every MoE layer, the previous implementation never;
- Llama-4's MoE block rule (router scores on the experts' *input*): block output, router logits and every gradient
  vs transformers' block for top-1 / top-3 of 4 experts, on foak's torch reference and on the Triton kernels;
  a hooked experts module runs transformers' block, counted with the reason; PEFT LoRA on every linear layer
  but the router (all-linear also wraps Llama4Router, an nn.Linear returning a tuple, which fails unpatched);
- DeepSeek's interleaved RoPE dispatcher vs transformers' ``apply_rotary_pos_emb_interleave`` (fp32 / bf16,
  forward and backward, both layouts, cos/sin whose halves differ), and DeepSeek-V3 with ``rope_interleave=False``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import foak
from foak.patching import moe as moe_patching
from foak.patching import replacements
from foak.patching.moe import moe_counts
from foak.testing import relative_error

from test_architectures import SPECS, batch_of, build, loss_and_grads

MOE_ARCHS = {"qwen2_moe": 1, "glm4_moe": 1, "glm4_moe_lite": 1, "deepseek_v3": 1, "granitemoeshared": 2,
             "llama4_text": 1}  # arch -> MoE layers of its matrix model
TOL = 1e-5


@pytest.fixture(autouse=True)
def _reference_backend():
    foak.set_backend("reference")
    yield
    foak.set_backend("auto")


def _close(out, ref, what, tol=TOL):
    err = relative_error(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def _grads_close(model, ref, what):
    ref_params = dict(ref.named_parameters())
    compared = 0
    for name, p in model.named_parameters():
        r = ref_params[name]
        assert (p.grad is None) == (r.grad is None), f"{what}: grad of {name} on one side only"
        if p.grad is not None:
            _close(p.grad, r.grad, f"{what}: grad of {name}")
            compared += 1
    assert compared


@pytest.mark.parametrize("arch", list(MOE_ARCHS))
def test_moe_row_counts_foak_calls(arch):
    model = build(arch)
    report = foak.patch(model)
    try:
        out, _ = loss_and_grads(model, batch_of("padded"))
        assert torch.isfinite(out.loss)
        # one forward: one foak call per MoE layer, none of transformers' own
        assert moe_counts(report, f"{arch}.moe") == (MOE_ARCHS[arch], {}), str(report)
        assert f"foak moe_experts ran {MOE_ARCHS[arch]} call" in report.result(f"{arch}.moe").notes
    finally:
        foak.restore(model)


# ---- Llama-4: the MoE block --------------------------------------------------------------------------


def _llama4_block(top_k: int, seed: int = 0):
    from transformers import Llama4TextConfig
    from transformers.models.llama4 import modeling_llama4 as modeling

    config = Llama4TextConfig(hidden_size=32, intermediate_size=24, num_local_experts=4, num_experts_per_tok=top_k)
    torch.manual_seed(seed)
    block = modeling.Llama4TextMoe(config).float()
    with torch.no_grad():  # torch.zeros / empty at construction: draw every weight
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


class _Holder(torch.nn.Module):
    """A model around one block, so that foak.patch's rules_for sees model_type llama4_text."""

    def __init__(self, block):
        super().__init__()
        self.config = type("C", (), {"model_type": "llama4_text", "hidden_act": "silu"})()
        self.block = block


@pytest.mark.parametrize("backend", ["reference", "auto"])  # auto: the Triton kernels (the interpreter here)
@pytest.mark.parametrize("top_k", [1, 3])
def test_llama4_block_matches_transformers(top_k, backend):
    foak.set_backend(backend)
    block = _llama4_block(top_k)
    ref = copy.deepcopy(block)
    holder = _Holder(block)
    report = foak.patch(holder)
    try:
        assert report.count("llama4_text.moe") == 1, str(report)
        x = torch.randn(2, 7, 32, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        out, logits = block(x)
        ref_out, ref_logits = ref(x_ref)
        _close(out, ref_out, "block output")
        assert torch.equal(logits, ref_logits)
        g = torch.randn_like(out)
        out.backward(g)
        ref_out.backward(g)
        _close(x.grad, x_ref.grad, "input grad")
        _grads_close(block, ref, f"llama4 block top-{top_k}")
        assert block.router.weight.grad.abs().sum() > 0  # the router is trained through the input-side scores
        assert moe_counts(report, "llama4_text.moe") == (1, {})
    finally:
        foak.restore(holder)


def test_llama4_block_hooked_experts_run_transformers_counted():
    block = _llama4_block(2)
    ref = copy.deepcopy(block)
    holder = _Holder(block)
    report = foak.patch(holder)
    try:
        seen = []
        block.experts.register_forward_hook(lambda m, args, out: seen.append(out.shape))
        x = torch.randn(5, 32)
        out, _ = block(x)
        _close(out, ref(x)[0], "hooked block output")
        assert seen == [(4 * 5, 32)]  # transformers' block ran its experts on every (expert, token) row
        foak_calls, other = moe_counts(report, "llama4_text.moe")
        assert foak_calls == 0 and list(other.values()) == [1] and "hooks" in next(iter(other)), other
        assert "previous implementation (Llama4TextMoe.forward) ran 1 call" in report.result("llama4_text.moe").notes
    finally:
        foak.restore(holder)


def test_llama4_lora_every_linear_but_the_router():
    peft = pytest.importorskip("peft")
    model = build("llama4_text")
    targets = [n for n, m in model.named_modules()
               if type(m) is torch.nn.Linear and m is not model.lm_head]  # Llama4Router is a subclass: left out
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(model, config)
    ref = copy.deepcopy(model)
    report = foak.patch(model)
    try:
        assert report.count("llama4_text.fused_lora") == len(targets), str(report)
        for kind in ("padded", "packed"):
            batch = batch_of(kind)
            out, _ = loss_and_grads(model, batch)
            ref_out, _ = loss_and_grads(ref, batch)
            _close(out.loss, ref_out.loss, f"LoRA {kind} loss")
            _grads_close(model, ref, f"LoRA {kind}")
        assert moe_counts(report, "llama4_text.moe") == (2, {})
    finally:
        foak.restore(model)


# ---- DeepSeek's interleaved RoPE --------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_interleaved_rope_matches_transformers(unsqueeze_dim, dtype, backend):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave as hf

    foak.set_backend(backend)
    B, H, S, D = 2, 3, 5, 10
    g = torch.Generator().manual_seed(0)
    shape_q, shape_k = ((B, H, S, D), (B, 1, S, D)) if unsqueeze_dim == 1 else ((B, S, H, D), (B, S, 1, D))
    q = torch.randn(shape_q, generator=g).to(dtype).requires_grad_(True)
    k = torch.randn(shape_k, generator=g).to(dtype).requires_grad_(True)
    # halves that differ: transformers reads the first half only, and so must foak
    cos, sin = (torch.randn(B, S, D, generator=g).to(dtype) for _ in range(2))
    foak_rope = replacements._foak_apply_rotary_pos_emb_interleave(hf)
    previous = replacements._ROPE_ACTIVE.on
    replacements._ROPE_ACTIVE.on = True
    try:
        q_out, k_out = foak_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
    finally:
        replacements._ROPE_ACTIVE.on = previous
    q_ref, k_ref = (t.detach().clone().requires_grad_(True) for t in (q, k))
    q_hf, k_hf = hf(q_ref, k_ref, cos, sin, unsqueeze_dim=unsqueeze_dim)
    tol = TOL if dtype == torch.float32 else 1e-2
    assert q_out.dtype == q_hf.dtype and q_out.shape == q_hf.shape
    _close(q_out, q_hf, "q", tol)
    _close(k_out, k_hf, "k", tol)
    dq, dk = torch.randn_like(q_out), torch.randn_like(k_out)
    torch.autograd.backward((q_out, k_out), (dq, dk))
    torch.autograd.backward((q_hf, k_hf), (dq, dk))
    _close(q.grad, q_ref.grad, "dq", tol)
    _close(k.grad, k_ref.grad, "dk", tol)


def test_deepseek_v3_without_rope_interleave(monkeypatch):
    spec = SPECS["deepseek_v3"]
    monkeypatch.setitem(spec.kwargs, "rope_interleave", False)
    model = build("deepseek_v3")
    assert model.config.rope_interleave is False
    ref = copy.deepcopy(model)
    calls = []
    rope = replacements.rope
    monkeypatch.setattr(replacements, "rope", lambda *a, **k: calls.append(1) or rope(*a, **k))
    foak.patch(model)
    try:
        batch = batch_of("padded")
        out, _ = loss_and_grads(model, batch)
        ref_out, _ = loss_and_grads(ref, batch)
        _close(out.loss, ref_out.loss, "loss")
        _grads_close(model, ref, "deepseek_v3 rope_interleave=False")
        assert len(calls) == 2  # both layers' q_rot / k_rot through foak's rope op
    finally:
        foak.restore(model)


# ---- GraniteMoE-Shared: the shared expert (gate|up rows in one input_linear) ------------------------------


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_granitemoeshared_shared_mlp_matches_transformers(backend):
    from transformers import GraniteMoeSharedConfig
    from transformers.models.granitemoeshared import modeling_granitemoeshared as modeling

    foak.set_backend(backend)
    config = GraniteMoeSharedConfig(hidden_size=24, shared_intermediate_size=20, hidden_act="silu")
    torch.manual_seed(0)
    mlp = modeling.GraniteMoeSharedMLP(config)
    ref = copy.deepcopy(mlp)
    holder = _Holder(mlp)
    holder.config.model_type = "granitemoeshared"
    report = foak.patch(holder)
    try:
        assert report.count("granitemoeshared.swiglu") == 1, str(report)
        calls = []
        glu_linear = replacements.glu_linear
        replacements.glu_linear = lambda *a, **k: calls.append(1) or glu_linear(*a, **k)
        try:
            x = torch.randn(3, 5, 24, requires_grad=True)
            out = mlp(x)
        finally:
            replacements.glu_linear = glu_linear
        x_ref = x.detach().clone().requires_grad_(True)
        ref_out = ref(x_ref)
        assert calls == [1]
        _close(out, ref_out, "shared MLP output")
        g = torch.randn_like(out)
        out.backward(g)
        ref_out.backward(g)
        _close(x.grad, x_ref.grad, "input grad")
        _grads_close(mlp, ref, "shared MLP")
    finally:
        foak.restore(holder)


def test_llama4_lora_on_the_experts_weights_is_left_to_transformers_and_said():
    peft = pytest.importorskip("peft")
    model = build("llama4_text")
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False,
                             target_parameters=["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"])
    model = peft.get_peft_model(model, config)
    ref = copy.deepcopy(model)
    report = foak.patch(model)
    try:
        assert report.count("llama4_text.moe") == 0
        assert "not Llama4TextExperts (e.g. PEFT LoRA" in report.result("llama4_text.moe").notes, str(report)
        batch = batch_of("padded")
        out, _ = loss_and_grads(model, batch)
        ref_out, _ = loss_and_grads(ref, batch)
        _close(out.loss, ref_out.loss, "loss")
        _grads_close(model, ref, "LoRA on the experts' weights")
    finally:
        foak.restore(model)


def test_a_llama4_checkpoint_is_served_as_its_text_model():
    """A Llama-4 checkpoint's config.json says "llama4"; AutoModelForCausalLM builds Llama4ForCausalLM over its
    text config ("llama4_text"), which foak serves: the CLI's --model checks accept it."""
    from foak.models import ARCHITECTURES, LOADED_AS, served_model_type
    from foak.train import check_architecture

    config = transformers.Llama4Config(text_config=dict(
        hidden_size=32, intermediate_size=48, intermediate_size_mlp=48, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=64, num_local_experts=2))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert model.config.model_type == served_model_type("llama4") == LOADED_AS["llama4"] in ARCHITECTURES
    check_architecture("llama4", None)  # no error
    with pytest.raises(ValueError, match="no kernels for model_type 'llama5'"):
        check_architecture("llama5", type("A", (), {"model": "x"})())
