"""foak.ops.lora_glu_linear (a gated MLP's LoRA down projection, the product recomputed in the backward)
against a real PEFT lora.Linear applied to torch's act(g) * u, and fp64 math; in the Triton interpreter."""

import pytest
import torch
from torch import nn

from foak.ops.lora import lora_dropout_mask
from foak.ops.lora_glu_linear import lora_glu_linear
from foak.testing import relative_error
from test_lora_op import _args, _peft_layer, _saved_bytes, _use_mask

ACT = {"silu": nn.functional.silu, "gelu": nn.functional.gelu,
       "gelu_tanh": lambda g: nn.functional.gelu(g, approximate="tanh")}


def _peft_down(g, u, layer, activation):
    return layer(ACT[activation](g) * u)


def _run(fn, g, u, layer, dy):
    g, u = g.detach().clone().requires_grad_(), u.detach().clone().requires_grad_()
    out = fn(g * 1, u * 1)  # intermediates, as in a model (the op may reuse their memory)
    leaves = (g, u, layer.lora_A["default"].weight, layer.lora_B["default"].weight)
    return out, torch.autograd.grad(out, leaves, dy)


CASES = [  # (tokens shape, intermediate, out, r, bias, p, activation)
    ((3, 7), 131, 37, 5, True, 0.0, "silu"),
    ((19,), 1100, 9, 7, False, 0.3, "gelu_tanh"),  # more than one kernel block per row
    ((2, 5), 40, 23, 3, False, 0.1, "gelu"),
]


@pytest.mark.parametrize(("lead", "inter", "out_f", "r", "bias", "p", "activation"), CASES)
def test_fp32_matches_peft_and_fp64(lead, inter, out_f, r, bias, p, activation):
    _, layer = _peft_layer(inter, out_f, r, alpha=11, dropout=p, bias=bias)
    gen = torch.Generator().manual_seed(2)
    g, u = torch.randn(*lead, inter, generator=gen), torch.randn(*lead, inter, generator=gen)
    dy = torch.randn(*lead, out_f, generator=gen)
    seed = 77
    if p > 0:
        _use_mask(layer, lora_dropout_mask(seed, (*lead, inter), p), p)
    out, grads = _run(lambda a, b: lora_glu_linear(a, b, *_args(layer), dropout_p=p, seed=seed,
                                                   activation=activation), g, u, layer, dy)
    ref_out, ref_grads = _run(lambda a, b: _peft_down(a, b, layer, activation), g, u, layer, dy)
    assert out.dtype == ref_out.dtype == torch.float32
    errors = [relative_error(out, ref_out)] + [relative_error(a, b) for a, b in zip(grads, ref_grads)]
    assert max(errors) <= 1e-5, errors
    # fp64 math (not PEFT): the same function
    layer64 = layer.double()
    out64, grads64 = _run(lambda a, b: _peft_down(a, b, layer64, activation), g.double(), u.double(), layer64,
                          dy.double())
    assert max(relative_error(a, b) for a, b in zip((out, *grads), (out64, *grads64))) <= 1e-5


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_bf16_within_twice_peft_error(p):
    inter, out_f, r = 150, 33, 6
    _, layer = _peft_layer(inter, out_f, r, dropout=p, base_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    g32, u32 = torch.randn(23, inter, generator=gen), torch.randn(23, inter, generator=gen)
    dy32 = torch.randn(23, out_f, generator=gen)
    if p > 0:
        _use_mask(layer, lora_dropout_mask(5, (23, inter), p), p)
    out, grads = _run(lambda a, b: lora_glu_linear(a, b, *_args(layer), dropout_p=p, seed=5), g32.bfloat16(),
                      u32.bfloat16(), layer, dy32.bfloat16())
    peft_out, peft_grads = _run(lambda a, b: _peft_down(a, b, layer, "silu"), g32.bfloat16(), u32.bfloat16(),
                                layer, dy32.bfloat16())
    layer32 = layer.float()
    ref_out, ref_grads = _run(lambda a, b: _peft_down(a, b, layer32, "silu"), g32, u32, layer32, dy32)
    for ours, peft, ref in zip((out, *grads), (peft_out, *peft_grads), (ref_out, *ref_grads)):
        assert ours.dtype == peft.dtype
        err, peft_err = relative_error(ours.float(), ref), relative_error(peft.float(), ref)
        assert err <= 2e-2 and err <= 2 * peft_err + 1e-3, (err, peft_err)


def test_fp32_adapters_under_autocast_and_saved_memory():
    """bf16 autocast over a bf16 base with fp32 adapters: as PEFT under the same autocast (bf16 output,
    fp32 adapter gradients), saving g, u and the rank-sized product only (PEFT also keeps act(g) * u)."""
    inter, out_f, r, tokens = 96, 40, 8, 32
    _, layer = _peft_layer(inter, out_f, r, dropout=0.1, base_dtype=torch.bfloat16, adapter_dtype=torch.float32)
    gen = torch.Generator().manual_seed(6)
    g, u = torch.randn(tokens, inter, generator=gen).bfloat16(), torch.randn(tokens, inter, generator=gen).bfloat16()
    dy = torch.randn(tokens, out_f, generator=gen).bfloat16()
    _use_mask(layer, lora_dropout_mask(9, (tokens, inter), 0.1), 0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, grads = _run(lambda a, b: lora_glu_linear(a, b, *_args(layer), dropout_p=0.1, seed=9), g, u, layer, dy)
        ref_out, ref_grads = _run(lambda a, b: _peft_down(a, b, layer, "silu"), g, u, layer, dy)
        gl, ul = g.clone().requires_grad_(), u.clone().requires_grad_()
        params = list(_args(layer)[:4])
        _, foak_bytes = _saved_bytes(lambda: lora_glu_linear(gl * 1, ul * 1, *_args(layer), dropout_p=0.1, seed=9),
                                     params)
        _, peft_bytes = _saved_bytes(lambda: _peft_down(gl * 1, ul * 1, layer, "silu"), params)
    assert out.dtype == ref_out.dtype == torch.bfloat16
    assert [t.dtype for t in grads[2:]] == [torch.float32] * 2
    for ours, ref in zip((out, *grads), (ref_out, *ref_grads)):
        assert relative_error(ours.float(), ref.float()) <= 2e-2
    act_bytes = tokens * inter * 2
    adapter_casts = (r * inter + out_f * r) * 2  # autocast's bf16 copies of A and B (PEFT too)
    assert foak_bytes <= 2 * act_bytes + tokens * r * 2 + 8 + adapter_casts, foak_bytes
    assert foak_bytes <= peft_bytes - act_bytes, (foak_bytes, peft_bytes)


def test_non_contiguous_inputs_and_errors():
    _, layer = _peft_layer(40, 9, 3)
    gu = torch.randn(6, 80)
    g, u = gu[:, 0::2], gu[:, 1::2]  # strided views
    out = lora_glu_linear(g, u, *_args(layer))
    assert relative_error(out, _peft_down(g, u, layer, "silu")) <= 1e-5
    with pytest.raises(ValueError, match="activation"):
        lora_glu_linear(g, u, *_args(layer), activation="relu")
    with pytest.raises(ValueError, match="weight must be"):
        lora_glu_linear(g[:, :39], u[:, :39], *_args(layer))
    with pytest.raises(ValueError, match="frozen in LoRA"):
        w, b, a, bb, s = _args(layer)
        lora_glu_linear(g, u, w.clone().requires_grad_(), b, a, bb, s)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recompute_stops_before_the_base_gemm(monkeypatch, reentrant):
    # under non-reentrant checkpointing the recompute stops once the op's tensors are saved again, before the
    # base GEMM and the adapter's up projection (as it stops before an nn.Linear's GEMM); reentrant checkpointing
    # recomputes everything. Gradients (dropout's regenerated mask included) equal the un-checkpointed op's.
    import foak.ops.lora_glu_linear as module
    from torch.utils.checkpoint import checkpoint

    inter, out_f, r, p = 131, 37, 5, 0.2
    _, layer = _peft_layer(inter, out_f, r, alpha=11, dropout=p, bias=True)
    gen = torch.Generator().manual_seed(4)
    g, u = torch.randn(3, 7, inter, generator=gen), torch.randn(3, 7, inter, generator=gen)
    dy = torch.randn(3, 7, out_f, generator=gen)

    def op(a, b):
        return lora_glu_linear(a * 1, b * 1, *_args(layer), dropout_p=p, seed=5)

    _, want = _run(op, g, u, layer, dy)
    outputs = [0]
    original = module._output

    def counting(*args):
        outputs[0] += 1
        return original(*args)

    monkeypatch.setattr(module, "_output", counting)
    gc, uc = g.clone().requires_grad_(), u.clone().requires_grad_()
    lora_A, lora_B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    lora_A.grad = lora_B.grad = None
    checkpoint(op, gc, uc, use_reentrant=reentrant).backward(dy)
    got = (gc.grad, uc.grad, lora_A.grad, lora_B.grad)
    assert max(relative_error(a, b) for a, b in zip(got, want)) <= 1e-6
    assert outputs[0] == (2 if reentrant else 1)
