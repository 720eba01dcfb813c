"""A gated MLP's down projection: ``linear(act(g) * u, weight, bias)`` without keeping ``act(g) * u``.

A plain ``down_proj(glu(g, u))`` keeps three [tokens, intermediate] activations alive until the backward:
``g`` and ``u`` (for the activation's gradient) and the product (for the weight gradient). Here the
product is not saved: the backward first computes its gradient ``dh = dout @ weight``, then one kernel
reads ``dh, g, u`` and writes ``dg, du`` and the product itself (into ``dh``'s memory, which is no longer
needed), and finally ``dweight = dout^T @ product``. That is one [tokens, intermediate] activation less per
layer (a quarter of the MLP's saved memory) for one extra elementwise write in the backward. ``dg, du`` go
into the memory of ``g, u`` under the same rules as :func:`foak.ops.activations.glu`.
"""

from __future__ import annotations

import torch

from foak.backend import use_triton
from foak.ops._checks import check_float_tensor, check_same_device, check_same_dtype
from foak.ops._custom_op import custom_op
from foak.ops._inplace import can_overwrite, claim, overwritten
from foak.ops._save_first import save_first, saved, token_grad
from foak.ops.activations import _backward_launch, _glu_forward_op, check_glu_inputs, glu_reference


# 1. reference -------------------------------------------------------------------------------------
def glu_linear_reference(g, u, weight, bias=None, activation: str = "silu") -> torch.Tensor:
    return torch.nn.functional.linear(glu_reference(g, u, activation), weight, bias)


# 2./3. kernels and launchers: foak.ops.activations (the GLU backward kernel with STORE_H) ---------------


# 4. custom op and autograd -----------------------------------------------------------------------
def _backward_fake(dh, g, u, activation):
    return g.new_empty(g.shape), u.new_empty(u.shape), dh.new_empty(dh.shape)


@custom_op("glu_backward_and_output", _backward_fake)
def _backward_op(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, activation: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dg, du, h = g.new_empty(g.shape), u.new_empty(u.shape), dh.new_empty(dh.shape)
    _backward_launch(dh, g, u, dg, du, activation, h=h)
    return dg, du, h


def _backward(dout, g, u, weight, activation, inplace_backward, want_dweight, want_dbias):
    dout2 = dout.reshape(-1, dout.shape[-1])
    dh = (dout2 @ weight).view(g.shape)  # fresh and contiguous: the kernel may write the product into it
    if inplace_backward:
        # eager only: each thread reads dh[i], g[i], u[i] before writing dg[i], du[i], h[i] over them
        _backward_launch(dh, g, u, g, u, activation, h=dh)
        overwritten(g, u)
        dg, du, h = g, u, dh
    else:
        dg, du, h = _backward_op(dh, g, u, activation)
    dweight = dout2.t() @ h.reshape(-1, h.shape[-1]) if want_dweight else None
    dbias = dout2.sum(0) if want_dbias else None
    return dg, du, dweight, dbias


class _GLULinearFunction(torch.autograd.Function):
    """Saves g, u and weight itself (after its forward): the path under torch.compile."""

    @staticmethod
    def forward(ctx, g, u, weight, bias, activation, inplace_backward):
        out = torch.nn.functional.linear(_glu_forward_op(g, u, activation), weight, bias)
        ctx.save_for_backward(g, u, weight)
        ctx.activation, ctx.inplace_backward, ctx.has_bias = activation, inplace_backward, bias is not None
        return out

    @staticmethod
    def backward(ctx, dout):
        g, u, weight = ctx.saved_tensors
        return (*_backward(dout, g, u, weight, ctx.activation, ctx.inplace_backward, ctx.needs_input_grad[2],
                           ctx.has_bias and ctx.needs_input_grad[3]), None, None)


class _GLULinearAfterSave(torch.autograd.Function):
    """The eager path: g, u and weight were saved by foak.ops._save_first ahead of this node, so a non-reentrant
    checkpoint's recompute stops before the GEMM (as it does before an nn.Linear's), not after it."""

    @staticmethod
    def forward(ctx, token, g, u, weight, bias, activation, inplace_backward, saver):
        ctx.saver, ctx.token = saver, (token.dtype, token.device)
        ctx.activation, ctx.inplace_backward, ctx.has_bias = activation, inplace_backward, bias is not None
        return torch.nn.functional.linear(_glu_forward_op(g, u, activation), weight, bias)

    @staticmethod
    def backward(ctx, dout):
        g, u, weight = saved(ctx.saver)
        grads = _backward(dout, g, u, weight, ctx.activation, ctx.inplace_backward, ctx.needs_input_grad[3],
                          ctx.has_bias and ctx.needs_input_grad[4])
        return (token_grad(ctx.token), *grads, None, None, None)


# 5. public function -------------------------------------------------------------------------------
def glu_linear(g: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               activation: str = "silu", inplace_backward: bool = True) -> torch.Tensor:
    """``linear(act(g) * u, weight, bias)``; g and u are [..., intermediate], weight [out, intermediate].

    Under autocast the weight (and bias) are cast to the autocast dtype first, as ``nn.Linear`` would."""
    op = "glu_linear"
    check_glu_inputs(op, g, u, activation)
    check_float_tensor(op, "weight", weight)
    if bias is not None:
        check_float_tensor(op, "bias", bias)
    check_same_device(op, g=g, u=u, weight=weight, bias=bias)
    if weight.dim() != 2 or weight.shape[1] != g.shape[-1]:
        raise ValueError(f"{op}: weight must be [out_features, {g.shape[-1]}] for g of shape {tuple(g.shape)}; "
                         f"got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"{op}: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    device_type = g.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        g, u, weight = g.to(dtype), u.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    check_same_dtype(op, g=g, u=u, weight=weight, bias=bias)
    if not use_triton(g.device):
        return glu_linear_reference(g, u, weight, bias, activation)
    inplace = bool(inplace_backward) and can_overwrite(g, u)
    if inplace:
        claim(g, u)
    with torch.autocast(device_type, enabled=False):
        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return _GLULinearFunction.apply(g, u, weight, bias, activation, inplace)
        token, saver = save_first(g, u, weight)
        return _GLULinearAfterSave.apply(token, g, u, weight, bias, activation, inplace, saver)
