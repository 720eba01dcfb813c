"""Gated MLP activations: SwiGLU ``silu(g) * u`` and GeGLU ``gelu(g) * u`` (exact erf or tanh form).

The backward recomputes the activation from ``g`` instead of saving it. When ``g`` and ``u`` are
intermediate activations (they have a ``grad_fn`` and are not views, as the outputs of separate gate/up
projections are) in separate contiguous memory, the backward writes ``dg`` and ``du`` into their storage, so it allocates nothing; their
version counters are bumped, so any other op that saved them raises autograd's usual in-place error
instead of computing with overwritten values. Pass ``inplace_backward=False`` to keep them intact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foak.backend import use_triton
from foak.ops._checks import check_float_tensor, check_same_device, check_same_dtype, rows_view

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
_ACT_ID = {name: i for i, name in enumerate(ACTIVATIONS)}
# Launch knobs; benchmarks/ops.py sweeps them on the GPU.
TUNING = {"block": 4096, "warps": None}


# 1. reference -------------------------------------------------------------------------------------
def glu_reference(g: torch.Tensor, u: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(g) * u computed in fp32 and cast back to the input dtype."""
    gf = g.float()
    if activation == "silu":
        a = torch.nn.functional.silu(gf)
    elif activation == "gelu":
        a = torch.nn.functional.gelu(gf, approximate="none")
    else:
        a = torch.nn.functional.gelu(gf, approximate="tanh")
    return (a * u.float()).to(g.dtype)


def swiglu_reference(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return glu_reference(g, u, "silu")


def geglu_reference(g: torch.Tensor, u: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return glu_reference(g, u, "gelu_tanh" if approximate == "tanh" else "gelu")


# 2. kernels ---------------------------------------------------------------------------------------
@triton.jit
def _activation_and_grad(g, ACT: tl.constexpr, NEED_GRAD: tl.constexpr):
    """act(g) and, if NEED_GRAD, d act / d g; g is fp32."""
    if ACT == 0:  # silu
        s = tl.sigmoid(g)
        a = g * s
        if NEED_GRAD:
            da = s * (1.0 + g * (1.0 - s))
        else:
            da = a
    elif ACT == 1:  # exact gelu: 0.5 g (1 + erf(g / sqrt2))
        cdf = 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
        a = g * cdf
        if NEED_GRAD:
            da = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
        else:
            da = a
    else:  # tanh gelu; tanh(z) = 2 sigmoid(2z) - 1 (no libdevice: it also runs in the interpreter)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 * tl.sigmoid(2.0 * z) - 1.0
        a = 0.5 * g * (1.0 + t)
        if NEED_GRAD:
            dz = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
            da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * dz
        else:
            da = a
    return a, da


@triton.jit
def _glu_forward_kernel(
    G, g_stride, U, u_stride, H, h_stride, n_cols, ACT: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(G + row * g_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * u_stride + cols, mask=mask, other=0.0).to(tl.float32)
    a, _ = _activation_and_grad(g, ACT, False)
    tl.store(H + row * h_stride + cols, (a * u).to(H.dtype.element_ty), mask=mask)


@triton.jit
def _glu_backward_kernel(
    DH, dh_stride, G, g_stride, U, u_stride, DG, dg_stride, DU, du_stride, n_cols,
    ACT: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dh = tl.load(DH + row * dh_stride + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * g_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * u_stride + cols, mask=mask, other=0.0).to(tl.float32)
    a, da = _activation_and_grad(g, ACT, True)
    tl.store(DG + row * dg_stride + cols, (dh * u * da).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * du_stride + cols, (dh * a).to(DU.dtype.element_ty), mask=mask)


# 3. launchers -------------------------------------------------------------------------------------
def _grid(n_rows: int, n_cols: int) -> tuple[tuple[int, int], int, int]:
    block = min(TUNING["block"], triton.next_power_of_2(n_cols))
    num_warps = TUNING["warps"] or (8 if block >= 2048 else 4)
    return (n_rows, triton.cdiv(n_cols, block)), block, num_warps


def _forward_launch(g: torch.Tensor, u: torch.Tensor, activation: str) -> torch.Tensor:
    n_cols = g.shape[-1]
    g2, u2 = rows_view(g, n_cols), rows_view(u, n_cols)
    h = torch.empty(g2.shape, dtype=g.dtype, device=g.device)
    grid, block, num_warps = _grid(g2.shape[0], n_cols)
    if h.numel():
        _glu_forward_kernel[grid](
            g2, g2.stride(0), u2, u2.stride(0), h, h.stride(0), n_cols,
            ACT=_ACT_ID[activation], BLOCK=block, num_warps=num_warps,
        )
    return h.view(g.shape)


def _backward_launch(dh, g, u, dg, du, activation: str) -> None:
    n_cols = g.shape[-1]
    dh2, g2, u2 = rows_view(dh, n_cols), rows_view(g, n_cols), rows_view(u, n_cols)
    dg2, du2 = dg.view(-1, n_cols), du.view(-1, n_cols)
    grid, block, num_warps = _grid(g2.shape[0], n_cols)
    if g2.numel():
        _glu_backward_kernel[grid](
            dh2, dh2.stride(0), g2, g2.stride(0), u2, u2.stride(0), dg2, dg2.stride(0), du2, du2.stride(0),
            n_cols, ACT=_ACT_ID[activation], BLOCK=block, num_warps=num_warps,
        )


# 4. custom ops and autograd -----------------------------------------------------------------------
@torch.library.custom_op("foak::glu_forward", mutates_args=())
def _glu_forward_op(g: torch.Tensor, u: torch.Tensor, activation: str) -> torch.Tensor:
    return _forward_launch(g, u, activation)


@_glu_forward_op.register_fake
def _(g, u, activation):
    return g.new_empty(g.shape)


@torch.library.custom_op("foak::glu_backward", mutates_args=())
def _glu_backward_op(
    dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    dg = g.new_empty(g.shape)  # contiguous (new_empty ignores the input layout)
    du = u.new_empty(u.shape)
    _backward_launch(dh, g, u, dg, du, activation)
    return dg, du


@_glu_backward_op.register_fake
def _(dh, g, u, activation):
    return g.new_empty(g.shape), u.new_empty(u.shape)


@torch.library.custom_op("foak::glu_backward_", mutates_args=("g", "u"))
def _glu_backward_inplace_op(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, activation: str) -> None:
    # the kernel reads g[i], u[i] and writes dg[i], du[i] in the same thread: overwriting is safe
    _backward_launch(dh, g, u, g, u, activation)


class _GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u, activation, inplace_backward):
        h = torch.ops.foak.glu_forward(g, u, activation)
        ctx.save_for_backward(g, u)
        ctx.activation = activation
        ctx.inplace_backward = inplace_backward
        return h

    @staticmethod
    def backward(ctx, dh):
        g, u = ctx.saved_tensors
        if ctx.inplace_backward:
            torch.ops.foak.glu_backward_(dh, g, u, ctx.activation)
            return g, u, None, None
        dg, du = torch.ops.foak.glu_backward(dh, g, u, ctx.activation)
        return dg, du, None, None


# 5. public functions ------------------------------------------------------------------------------
def _can_overwrite(g: torch.Tensor, u: torch.Tensor) -> bool:
    """True when g and u are intermediates whose memory the backward may reuse for dg and du."""
    if g.grad_fn is None or u.grad_fn is None:
        return False  # leaves (or tensors outside autograd) belong to the caller
    if g._is_view() or u._is_view():
        # a view may alias a leaf (x0[:n]) or come from a multi-output op (chunk/split), which autograd
        # forbids modifying in place: use the out-of-place backward
        return False
    if g.untyped_storage().data_ptr() == u.untyped_storage().data_ptr():
        return False  # e.g. swiglu(x, x): dg and du need separate memory
    for t in (g, u):
        if not t.is_contiguous():
            return False  # expanded or overlapping rows cannot hold distinct gradients
    return True


def glu(g: torch.Tensor, u: torch.Tensor, activation: str = "silu", inplace_backward: bool = True) -> torch.Tensor:
    """``act(g) * u`` for ``activation`` in ("silu", "gelu", "gelu_tanh"); g and u share shape and dtype."""
    op = "glu"
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    check_float_tensor(op, "g", g)
    check_float_tensor(op, "u", u)
    check_same_device(op, g=g, u=u)
    check_same_dtype(op, g=g, u=u)
    if g.shape != u.shape:
        raise ValueError(f"{op}: g and u must have the same shape; got {tuple(g.shape)} and {tuple(u.shape)}")
    if g.dim() < 1:
        raise ValueError(f"{op}: g and u must have at least one dimension, got scalars")
    if not use_triton(g.device):
        return glu_reference(g, u, activation)
    # under torch.compile the compiler plans memory itself (and grad_fn cannot be inspected)
    inplace = (
        bool(inplace_backward)
        and not torch.compiler.is_compiling()
        and torch.is_grad_enabled()
        and _can_overwrite(g, u)
    )
    if inplace:
        # other saved uses of g or u now fail loudly in their backward instead of reading gradients
        torch.autograd.graph.increment_version(g)
        torch.autograd.graph.increment_version(u)
    return _GLUFunction.apply(g, u, activation, inplace)


def swiglu(g: torch.Tensor, u: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """``silu(g) * u`` (the Llama/Mistral/Qwen MLP)."""
    return glu(g, u, "silu", inplace_backward)


def geglu(g: torch.Tensor, u: torch.Tensor, approximate: str = "none", inplace_backward: bool = True) -> torch.Tensor:
    """``gelu(g) * u`` with exact erf (``approximate="none"``) or the tanh form (``"tanh"``)."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"geglu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return glu(g, u, "gelu_tanh" if approximate == "tanh" else "gelu", inplace_backward)
