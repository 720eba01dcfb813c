"""RMSNorm, RoPE and the gated MLP under torch autocast over fp32 weights (HF Trainer's ``bf16=True`` with a
model loaded in fp32, and every LoRA run): each patched op must produce the dtype the HF module produces,
and fp32 master weights get fp32 gradients.

In HF Llama under bf16 autocast the residual stream stays fp32, LlamaRMSNorm returns fp32 (fp32 input
times fp32 weight), the linears run in bf16, cos/sin are fp32, so ``q * cos + rotate_half(q) * sin`` is
fp32 by type promotion, and the MLP product is bf16. Qwen3 adds q_norm/k_norm, whose input comes from a
bf16 linear and whose weight is fp32: HF returns fp32 there too.

Tolerance of the model comparison: 2e-2 relative (Frobenius) for the loss and each parameter gradient.
bf16 keeps 8 significant bits (spacing 2^-7 = 7.8e-3 at 1); foak fuses silu(g) * u and the rotation in
fp32 and rounds once, where HF rounds intermediate bf16 results, so the two differ by about one bf16
spacing per op, the size of autocast's own error (HF under autocast vs HF in fp32: ~8e-3 on this model).
A second check asks that foak is no further from the fp32 model than HF's autocast run is (1.25x + 1e-3).
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

import foak
from foak.models.tiny import tiny_model
from foak.testing import relative_error

TOL = 2e-2
KERNELS = dict(fast_rms_layernorm=True, fast_rope_embeddings=True, fast_swiglu=True)


@pytest.fixture
def auto_backend():
    yield
    foak.set_backend("auto")


def _run(model, ids, autocast=True):
    """Loss, gradients, every module's output dtype and every apply_rotary_pos_emb call's dtypes."""
    modeling = importlib.import_module(type(model).__module__)
    dtypes, rope_calls = {}, []
    handles = []
    for name, module in model.named_modules():
        def hook(module, args, out, name=name):
            out = out[0] if isinstance(out, tuple) else out
            if torch.is_tensor(out):
                dtypes[name] = out.dtype

        handles.append(module.register_forward_hook(hook))
    installed = modeling.apply_rotary_pos_emb  # foak's dispatcher while a patched model of its kind is alive

    def recording(q, k, cos, sin, *args, **kwargs):
        q_out, k_out = installed(q, k, cos, sin, *args, **kwargs)
        rope_calls.append({"q": q.dtype, "cos": cos.dtype, "q_out": q_out.dtype, "k_out": k_out.dtype})
        return q_out, k_out

    modeling.apply_rotary_pos_emb = recording
    try:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    finally:
        modeling.apply_rotary_pos_emb = installed
        for h in handles:
            h.remove()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return loss.detach(), grads, dtypes, rope_calls


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("backend", ["auto", "reference"])  # auto: the Triton kernels (interpreter)
def test_patched_model_under_autocast_matches_hf_dtypes_and_gradients(arch, backend, auto_backend):
    foak.set_backend(backend)
    hf = tiny_model(arch)
    fp32 = copy.deepcopy(hf)
    model = copy.deepcopy(hf)
    for m in (hf, fp32, model):
        m.train()
    foak.patch(model, **KERNELS)
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    try:
        loss, grads, dtypes, rope_calls = _run(model, ids)
        loss_hf, grads_hf, dtypes_hf, rope_calls_hf = _run(hf, ids)
        loss_32, grads_32, _, _ = _run(fp32, ids, autocast=False)
    finally:
        foak.restore(model)

    # dtypes: every module foak's patched forwards still run returns what HF's returns
    fused_away = {name for name in dtypes_hf if name.endswith("mlp.act_fn")}  # fused into the GLU kernel
    assert set(dtypes) == set(dtypes_hf) - fused_away
    assert {n: dtypes[n] for n in dtypes} == {n: dtypes_hf[n] for n in dtypes}
    assert dtypes["model.layers.0.input_layernorm"] == torch.float32  # the checks above are not vacuous
    assert dtypes["model.layers.0.mlp"] == torch.bfloat16
    if arch == "qwen3":
        assert dtypes["model.layers.0.self_attn.q_norm"] == torch.float32  # bf16 input, fp32 weight
    assert rope_calls == rope_calls_hf
    q_in = torch.float32 if arch == "qwen3" else torch.bfloat16  # qwen3: q/k pass through q_norm/k_norm first
    assert rope_calls[0] == {"q": q_in, "cos": torch.float32, "q_out": torch.float32, "k_out": torch.float32}
    # fp32 master weights get fp32 gradients
    assert all(g.dtype == torch.float32 for g in grads.values())

    assert relative_error(loss, loss_hf) < TOL
    for name in grads_hf:
        assert relative_error(grads[name], grads_hf[name]) < TOL, name
        # foak is no further from the fp32 model than HF's own autocast run (25% and 1e-3 of slack)
        own_error = relative_error(grads_hf[name], grads_32[name])
        assert relative_error(grads[name], grads_32[name]) < 1.25 * own_error + 1e-3, name


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("q_dtype, cos_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                                (torch.bfloat16, torch.bfloat16)])
def test_rope_output_is_the_promoted_dtype_and_grads_keep_q_dtype(backend, q_dtype, cos_dtype, auto_backend):
    foak.set_backend(backend)
    q = torch.randn(2, 7, 3, 16).to(q_dtype).transpose(1, 2).requires_grad_()  # HF layout
    k = torch.randn(2, 7, 1, 16).to(q_dtype).transpose(1, 2).requires_grad_()
    angles = torch.rand(1, 7, 6) * 6.3  # rotary dim 12 of head dim 16 (partial rotary)
    cos = torch.cat((angles, angles), -1).cos().to(cos_dtype)
    sin = torch.cat((angles, angles), -1).sin().to(cos_dtype)
    q_out, k_out = foak.rope(q, k, cos, sin)
    out_dtype = torch.promote_types(q_dtype, cos_dtype)
    assert q_out.dtype == k_out.dtype == out_dtype

    # HF's formula (the part up to the rotary dim; the rest passes through) in fp64
    def hf(x):
        c, s = cos.double()[:, None], sin.double()[:, None]
        xr = x.detach().double()
        rot = xr[..., :12] * c + _rotate_half(xr[..., :12]) * s
        return torch.cat((rot, xr[..., 12:]), -1)

    assert relative_error(q_out, hf(q)) < (1e-6 if out_dtype == torch.float32 else 8e-3)
    assert relative_error(k_out, hf(k)) < (1e-6 if out_dtype == torch.float32 else 8e-3)
    dq_out, dk_out = torch.randn_like(q_out), torch.randn_like(k_out)
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (dq_out, dk_out))
    assert dq.dtype == dk.dtype == q_dtype
    # the backward is the inverse rotation (its transpose) of the incoming gradient
    def inverse(g):
        c, s = cos.double()[:, None], sin.double()[:, None]
        gd = g.double()
        rot = gd[..., :12] * c - _rotate_half(gd[..., :12] * s)
        return torch.cat((rot, gd[..., 12:]), -1)

    tol = 1e-6 if q_dtype == torch.float32 else 8e-3
    assert relative_error(dq, inverse(dq_out)) < tol
    assert relative_error(dk, inverse(dk_out)) < tol


def test_rope_custom_op_with_an_output_dtype_passes_opcheck():
    q, k = torch.randn(2, 3, 7, 16, dtype=torch.bfloat16), torch.randn(2, 1, 7, 16, dtype=torch.bfloat16)
    cos, sin = torch.rand(1, 7, 12), torch.rand(1, 7, 12)
    tests = ("test_schema", "test_faketensor", "test_aot_dispatch_static")
    torch.library.opcheck(torch.ops.foak.rope, (q, k, cos, sin, None, False), test_utils=tests)
    dq, dk = q.float(), k.float()
    torch.library.opcheck(torch.ops.foak.rope, (dq, dk, cos, sin, None, True, torch.bfloat16), test_utils=tests)
    out = torch.ops.foak.rope(dq, dk, cos, sin, None, True, torch.bfloat16)
    assert out[0].dtype == out[1].dtype == torch.bfloat16


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_rms_norm_dtypes_under_autocast_follow_hf(backend, auto_backend):
    # LlamaRMSNorm: fp32 normalisation, cast to the input dtype, times the weight (type promotion);
    # Qwen3's q_norm/k_norm see bf16 inputs with fp32 weights under autocast
    foak.set_backend(backend)
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for x_dtype in (torch.float32, torch.bfloat16):
        norm = LlamaRMSNorm(24, eps=1e-6)
        norm.weight.data.normal_()
        x = torch.randn(3, 5, 24).to(x_dtype).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y_hf = norm(x)
            y = foak.rms_norm(x, norm.weight, 1e-6)
        assert y.dtype == y_hf.dtype == torch.float32
        dy = torch.randn_like(y)
        dx, dw = torch.autograd.grad(y, (x, norm.weight), dy)
        dx_hf, dw_hf = torch.autograd.grad(y_hf, (x, norm.weight), dy)
        assert dx.dtype == x_dtype and dw.dtype == torch.float32
        tol = 1e-5 if x_dtype == torch.float32 else 8e-3
        assert relative_error(y, y_hf) < tol
        assert relative_error(dx, dx_hf) < tol and relative_error(dw, dw_hf) < tol
