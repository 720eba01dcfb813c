"""The LoRA down projection of a gated MLP: ``lora_linear(act(g) * u, ...)`` without keeping ``act(g) * u``.

This is :func:`foak.ops.lora.lora_linear` applied to ``h = act(g) * u`` (SwiGLU / GeGLU), with
:func:`foak.ops.glu_linear.glu_linear`'s recompute: the forward saves ``g``, ``u`` (which the activation's
gradient needs anyway) and the small ``[tokens, r]`` adapter product, never ``h`` nor ``dropout(h)``.
The backward forms the gradient of ``h``,

    dh = dy W + s * mask / (1 - p) * ((dy B) A)

(a rank-sized GEMM pair, with dropout one elementwise kernel that applies the regenerated mask, then the
base GEMM accumulating onto it), then one GLU kernel reads ``dh, g, u`` and writes ``dg, du`` and ``h`` itself (into
``dh``'s memory), and ``dA = s * (dy B)^T dropout(h)`` (the mask regenerated once more), ``dB = s * dy^T (dropout(h) A^T)``. The base is frozen; ``weight`` is a dense tensor or a
quantized weight (see foak.ops.lora). Semantics (dtypes, autocast, dropout mask, scaling) are
:func:`foak.ops.lora.lora_linear`'s for the input ``h``: PEFT's ``lora.Linear`` over ``act(g) * u``.
"""

from __future__ import annotations

import torch

from foak.backend import use_triton
from foak.ops._custom_op import custom_op
from foak.ops._inplace import can_overwrite, claim, overwritten
from foak.ops._save_first import Saver, saved, token_grad
from foak.ops.activations import _backward_launch, _glu_forward_op, check_glu_inputs, glu_reference
from foak.ops.lora import (
    _adapter_input_grad,
    _adapter_output_grads,
    _add_input_grad_base,
    _dense,
    _down_projection,
    _down_weight_grad,
    _prepare_projection,
    _projection_output,
    _restore,
    _saveable,
    _seed_tensor,
    _split_output,
    lora_linear_reference,
)


# 1. reference -------------------------------------------------------------------------------------
def lora_glu_linear_reference(g, u, weight, bias, lora_A, lora_B, scaling, dropout_p=0.0, seed=None,
                              activation: str = "silu", result_dtype=None):
    return lora_linear_reference(glu_reference(g, u, activation), weight, bias, lora_A, lora_B, scaling,
                                 dropout_p, seed, result_dtype)


# 2./3. kernels and launchers: foak.ops.activations (GLU, with STORE_H) and foak.ops.lora (dropout) ----


# 4. custom op and autograd -----------------------------------------------------------------------
def _glu_backward_fake(dh, g, u, activation):
    return g.new_empty(g.shape), u.new_empty(u.shape)


@custom_op("lora_glu_backward", _glu_backward_fake, mutates_args=("dh",))
def _glu_backward_op(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, activation: str
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """dg, du in fresh memory; dh is overwritten by act(g) * u."""
    dg, du = g.new_empty(g.shape), u.new_empty(u.shape)
    _backward_launch(dh, g, u, dg, du, activation, h=dh)
    return dg, du


def _adapter_product(g, u, weight, lora_A, dropout_p, seed, activation, result_dtype):
    """h = act(g) * u as [tokens, intermediate], the input of the base GEMM (cast as bitsandbytes casts its input
    for a quantized base under autocast: result_dtype), and the rank-sized product dropout(h) A^T."""
    h = _glu_forward_op(g, u, activation)
    h2d = h.view(-1, h.shape[-1])
    h_c = h2d if result_dtype is None or h2d.dtype == weight.dtype else h2d.to(weight.dtype)
    return h2d, h_c, _down_projection(h_c, lora_A, dropout_p, seed)


def _output(h2d, h_c, weight, bias, small, lora_B, scaling, result_dtype):
    # result_dtype (a quantized base under autocast): the output is in it too (foak.ops.lora._split_output)
    if result_dtype is not None:
        return _split_output(h_c, weight, bias, small, lora_B, scaling,
                             h_c.new_empty((h_c.shape[0], weight.shape[0]), dtype=result_dtype))
    return _projection_output(h2d, weight, bias, small, lora_B, scaling)


def _backward(dout, saved, scaling, p, activation, inplace, split, need_A, need_B):
    """(dg, du, dA, dB) from the saved (g, u, weight, lora_A, lora_B, small, seed)."""
    with torch.autocast(dout.device.type, enabled=False):  # a backward run inside an autocast region
        g, u, weight, lora_A, lora_B, small, seed = saved
        s = scaling
        dy = dout.reshape(-1, dout.shape[-1])
        g2d, u2d = g.view(-1, g.shape[-1]), u.view(-1, u.shape[-1])
        if split:  # as foak.ops.lora._split_backward: PEFT's casts and sums, dh in g's dtype
            dy_c = dy if dy.dtype == weight.dtype else dy.to(weight.dtype)
            dy_s = dy_c if s == 1.0 else dy_c * s
            dB = torch.mm(dy_s.t(), small) if need_B else None
            gd = torch.mm(dy_s, lora_B)
            dh, _ = _adapter_input_grad(None, gd, lora_A, g2d, seed, p, weight.dtype, False)
            dh = dh if dh.dtype == g.dtype else dh.to(g.dtype)  # fresh and contiguous: h is written into it
            dh.add_(torch.mm(dy_c, _dense(weight, weight.dtype)))
        else:
            # gd: the gradient of the rank-sized product (scaling included)
            dB, gd = _adapter_output_grads(dy, small, lora_B, s, need_B)
            # the adapter's part (masked) first, then the base GEMM accumulates onto it: dh is fresh and contiguous
            dh, _ = _adapter_input_grad(None, gd, lora_A, g2d, seed, p, dy.dtype, False)
            dh = _add_input_grad_base(dh, [dy], [weight])
        if inplace:
            # eager only: each thread reads dh[i], g[i], u[i] before writing dg[i], du[i], h[i] over them
            _backward_launch(dh, g2d, u2d, g2d, u2d, activation, h=dh)
            overwritten(g, u)
            dg, du = g, u
        else:
            dg2d, du2d = _glu_backward_op(dh, g2d, u2d, activation)
            dg, du = dg2d.view(g.shape), du2d.view(u.shape)
        h2d = dh  # now act(g) * u
        dA = None
        if need_A:
            # the forward's adapter input again (dropout after the cast to the compute dtype)
            h_c = h2d.to(weight.dtype) if split and h2d.dtype != weight.dtype else h2d
            dA = _down_weight_grad(gd, h_c, lora_A, p, seed)
        return dg, du, dA, dB


class _LoRAGLULinearFunction(torch.autograd.Function):
    """Saves its tensors itself (after its forward): the path under torch.compile."""

    @staticmethod
    def forward(ctx, g, u, weight, bias, lora_A, lora_B, scaling, dropout_p, seed, activation, inplace,
                result_dtype):
        h2d, h_c, small = _adapter_product(g, u, weight, lora_A, dropout_p, seed, activation, result_dtype)
        out = _output(h2d, h_c, weight, bias, small, lora_B, scaling, result_dtype)
        saved, ctx.quantized = _saveable([g, u, weight, lora_A, lora_B, small, seed])
        ctx.save_for_backward(*saved)
        ctx.scaling, ctx.dropout_p, ctx.activation, ctx.inplace = scaling, dropout_p, activation, inplace
        ctx.split = result_dtype is not None
        return out.view(*g.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dout):
        dg, du, dA, dB = _backward(dout, _restore(ctx.saved_tensors, ctx.quantized), ctx.scaling, ctx.dropout_p,
                                   ctx.activation, ctx.inplace, ctx.split, ctx.needs_input_grad[4],
                                   ctx.needs_input_grad[5])
        return dg, du, None, None, dA, dB, None, None, None, None, None, None


class _LoRAGLUSave(torch.autograd.Function):
    """The eager path, first node: h and the rank-sized product, then the saved tensors, all before the base GEMM
    (the output node's), so a non-reentrant checkpoint's recompute stops before that GEMM (foak.ops._save_first).
    Returns the token linking it to the output node, h, the GEMM's input where a cast makes it another tensor
    (else an empty placeholder), and the rank-sized product; none of them differentiable."""

    @staticmethod
    def forward(ctx, saver, g, u, weight, lora_A, lora_B, seed, dropout_p, activation, result_dtype):
        h2d, h_c, small = _adapter_product(g, u, weight, lora_A, dropout_p, seed, activation, result_dtype)
        tensors, ctx.quantized = _saveable([g, u, weight, lora_A, lora_B, small, seed])
        ctx.save_for_backward(*tensors)
        saver.ctx = ctx
        cast = h_c if h_c is not h2d else h2d.new_empty(0)
        ctx.mark_non_differentiable(h2d, cast, small)
        return g.new_empty(0), h2d, cast, small

    @staticmethod
    def backward(ctx, *_grads):
        return (None,) * 10  # the output node returns every gradient; this node only held the saved tensors


class _LoRAGLUOutput(torch.autograd.Function):
    """The eager path, second node: the base GEMM and the adapter's up projection; saves nothing itself."""

    @staticmethod
    def forward(ctx, token, g, u, lora_A, h2d, cast, small, weight, bias, lora_B, scaling, dropout_p, activation,
                inplace, result_dtype, saver):
        ctx.saver, ctx.token = saver, (token.dtype, token.device)
        ctx.scaling, ctx.dropout_p, ctx.activation, ctx.inplace = scaling, dropout_p, activation, inplace
        ctx.split = result_dtype is not None
        out = _output(h2d, cast if cast.numel() else h2d, weight, bias, small, lora_B, scaling, result_dtype)
        return out.view(*g.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, dout):
        quantized = ctx.saver.ctx.quantized
        dg, du, dA, dB = _backward(dout, _restore(saved(ctx.saver), quantized), ctx.scaling,
                                   ctx.dropout_p, ctx.activation, ctx.inplace, ctx.split, ctx.needs_input_grad[3],
                                   ctx.needs_input_grad[9])
        return (token_grad(ctx.token), dg, du, dA, *(None,) * 5, dB,
                *(None,) * 6)


# 5. public function -------------------------------------------------------------------------------
def lora_glu_linear(g: torch.Tensor, u: torch.Tensor, weight, bias: torch.Tensor | None, lora_A: torch.Tensor,
                    lora_B: torch.Tensor, scaling: float, dropout_p: float = 0.0, seed=None,
                    activation: str = "silu", inplace_backward: bool = True) -> torch.Tensor:
    """``lora_linear(act(g) * u, weight, bias, lora_A, lora_B, scaling, dropout_p, seed)`` with the product
    recomputed in the backward instead of kept. g, u [..., intermediate]; weight [out, intermediate] (dense,
    frozen, or a quantized weight); lora_A [r, intermediate]; lora_B [out, r]. ``dg, du`` go into the memory
    of g and u when they are autograd intermediates nobody else reads (foak.ops._inplace)."""
    op = "lora_glu_linear"
    check_glu_inputs(op, g, u, activation)
    h_like = g  # the product has g's dtype and shape: lora_linear's checks of x apply to it
    _, weight, bias, lora_A, lora_B, scaling, dropout_p, result_dtype = _prepare_projection(
        op, h_like, weight, bias, lora_A, lora_B, scaling, dropout_p)
    device_type = g.device.type
    if torch.is_autocast_enabled(device_type) and result_dtype is None:  # (a quantized base casts act(g) * u)
        dtype = torch.get_autocast_dtype(device_type)
        g, u = g.to(dtype), u.to(dtype)
    if g.dtype != u.dtype:
        raise ValueError(f"{op}: g and u must share one dtype, got {g.dtype} and {u.dtype}")
    seed_t = _seed_tensor(op, seed, g.device) if dropout_p > 0 else None
    if not use_triton(g.device):
        return lora_glu_linear_reference(g, u, weight, bias, lora_A, lora_B, scaling, dropout_p, seed_t, activation,
                                         result_dtype)
    g, u = g.contiguous(), u.contiguous()
    inplace = bool(inplace_backward) and can_overwrite(g, u)
    if inplace:
        claim(g, u)
    with torch.autocast(device_type, enabled=False):
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return _LoRAGLULinearFunction.apply(g, u, weight, bias, lora_A, lora_B, scaling, dropout_p, seed_t,
                                                activation, inplace, result_dtype)
        saver = Saver()
        token, h2d, cast, small = _LoRAGLUSave.apply(saver, g, u, weight, lora_A, lora_B, seed_t, dropout_p,
                                                     activation, result_dtype)
        return _LoRAGLUOutput.apply(token, g, u, lora_A, h2d, cast, small, weight, bias, lora_B, scaling, dropout_p,
                                    activation, inplace, result_dtype, saver)
