"""Gated MLP activations: SwiGLU ``silu(g) * u`` and GeGLU ``gelu(g) * u`` (exact erf or tanh form).

The backward recomputes the activation from ``g`` instead of saving it. When ``g`` and ``u`` are
intermediate activations (they have a ``grad_fn`` and are not views, as the outputs of separate gate/up
projections are) in separate contiguous memory, the backward writes ``dg`` and ``du`` into their storage, so it allocates nothing (see
``foak/ops/_inplace.py`` for when that is safe and how misuse is caught). Pass ``inplace_backward=False`` to keep them intact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foak.backend import use_triton
from foak.ops._checks import check_float_tensor, check_same_device, check_same_dtype, rows_view
from foak.ops._custom_op import custom_op
from foak.ops._inplace import can_overwrite, claim, overwritten

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
_ACT_ID = {name: i for i, name in enumerate(ACTIVATIONS)}
# Launch knobs, swept on the GPU by benchmarks/tune_ops.py: at [16384, 14336] bf16 on the H200, blocks of
# 1024 elements with 4 warps were fastest (0.869 ms fwd+bwd); evict_first hints cost 4%.
TUNING = {"block": 1024, "warps": 4, "eviction": ""}


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
def _block_offsets(n_cols, n_col_blocks, BLOCK: tl.constexpr):
    # one 1-D grid over (row, column block); contiguous tensors arrive as a single row
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_col_blocks
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    return row, cols, cols < n_cols


@triton.jit
def _glu_forward_kernel(
    G, g_stride, U, u_stride, H, h_stride, n_cols, n_col_blocks,
    ACT: tl.constexpr, BLOCK: tl.constexpr, EVICTION: tl.constexpr,
):
    row, cols, mask = _block_offsets(n_cols, n_col_blocks, BLOCK)
    g = tl.load(G + row * g_stride + cols, mask=mask, other=0.0, eviction_policy=EVICTION).to(tl.float32)
    u = tl.load(U + row * u_stride + cols, mask=mask, other=0.0, eviction_policy=EVICTION).to(tl.float32)
    a, _ = _activation_and_grad(g, ACT, False)
    tl.store(H + row * h_stride + cols, (a * u).to(H.dtype.element_ty), mask=mask)


@triton.jit
def _glu_backward_kernel(
    DH, dh_stride, G, g_stride, U, u_stride, DG, dg_stride, DU, du_stride, H, h_stride, n_cols, n_col_blocks,
    ACT: tl.constexpr, BLOCK: tl.constexpr, EVICTION: tl.constexpr, STORE_H: tl.constexpr,
):
    row, cols, mask = _block_offsets(n_cols, n_col_blocks, BLOCK)
    dh = tl.load(DH + row * dh_stride + cols, mask=mask, other=0.0, eviction_policy=EVICTION).to(tl.float32)
    g = tl.load(G + row * g_stride + cols, mask=mask, other=0.0, eviction_policy=EVICTION).to(tl.float32)
    u = tl.load(U + row * u_stride + cols, mask=mask, other=0.0, eviction_policy=EVICTION).to(tl.float32)
    a, da = _activation_and_grad(g, ACT, True)
    tl.store(DG + row * dg_stride + cols, (dh * u * da).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * du_stride + cols, (dh * a).to(DU.dtype.element_ty), mask=mask)
    if STORE_H:  # the forward output again, for a consumer that did not keep it (foak.ops.glu_linear)
        tl.store(H + row * h_stride + cols, (a * u).to(H.dtype.element_ty), mask=mask)


# 3. launchers -------------------------------------------------------------------------------------
def _as_rows(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """[rows, cols] views with unit column stride; all-contiguous inputs become one long row."""
    if all(t.is_contiguous() for t in tensors):
        return [t.view(1, -1) for t in tensors]
    return [rows_view(t, t.shape[-1]) for t in tensors]


def _launch(kernel, tensors, activation: str, **constexprs) -> None:
    n_rows, n_cols = tensors[0].shape
    if n_rows * n_cols == 0:
        return
    block = min(TUNING["block"], triton.next_power_of_2(n_cols))
    num_warps = TUNING["warps"] or (8 if block >= 2048 else 4)
    n_col_blocks = triton.cdiv(n_cols, block)
    args = [a for t in tensors for a in (t, t.stride(0))]
    kernel[(n_rows * n_col_blocks,)](
        *args, n_cols, n_col_blocks,
        ACT=_ACT_ID[activation], BLOCK=block, EVICTION=TUNING["eviction"], num_warps=num_warps, **constexprs,
    )


def _forward_launch(g: torch.Tensor, u: torch.Tensor, activation: str) -> torch.Tensor:
    h = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    _launch(_glu_forward_kernel, _as_rows(g, u, h), activation)
    return h


def _backward_launch(dh, g, u, dg, du, activation: str, h=None) -> None:
    """dg/du may be g/u themselves, and h may be dh: each element is read before the same thread
    overwrites it. With ``h`` given, the kernel also writes the forward output ``act(g) * u`` there."""
    _launch(_glu_backward_kernel, _as_rows(dh, g, u, dg, du, dh if h is None else h), activation,
            STORE_H=h is not None)


# 4. custom ops and autograd -----------------------------------------------------------------------
def _glu_forward_fake(g, u, activation):
    return g.new_empty(g.shape)


@custom_op("glu_forward", _glu_forward_fake)
def _glu_forward_op(g: torch.Tensor, u: torch.Tensor, activation: str) -> torch.Tensor:
    return _forward_launch(g, u, activation)


def _glu_backward_fake(dh, g, u, activation):
    return g.new_empty(g.shape), u.new_empty(u.shape)


@custom_op("glu_backward", _glu_backward_fake)
def _glu_backward_op(
    dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    dg = g.new_empty(g.shape)  # contiguous (new_empty ignores the input layout)
    du = u.new_empty(u.shape)
    _backward_launch(dh, g, u, dg, du, activation)
    return dg, du


class _GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u, activation, inplace_backward):
        h = _glu_forward_op(g, u, activation)
        ctx.save_for_backward(g, u)
        ctx.activation = activation
        ctx.inplace_backward = inplace_backward
        return h

    @staticmethod
    def backward(ctx, dh):
        g, u = ctx.saved_tensors
        if ctx.inplace_backward:
            # eager only (never chosen while compiling): the kernel reads g[i], u[i] and writes
            # dg[i], du[i] from the same thread, so overwriting in place is safe
            _backward_launch(dh, g, u, g, u, ctx.activation)
            overwritten(g, u)
            return g, u, None, None
        dg, du = _glu_backward_op(dh, g, u, ctx.activation)
        return dg, du, None, None


# 5. public functions ------------------------------------------------------------------------------
def check_glu_inputs(op: str, g, u, activation: str) -> None:
    """The activation name, and g and u as float tensors of one shape (shared with glu_linear)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    check_float_tensor(op, "g", g)
    check_float_tensor(op, "u", u)
    if g.shape != u.shape:
        raise ValueError(f"{op}: g and u must have the same shape (one shape for both); got {tuple(g.shape)} "
                         f"and {tuple(u.shape)}")
    if g.dim() < 1:
        raise ValueError(f"{op}: g and u must have at least one dimension, got scalars")


def glu(g: torch.Tensor, u: torch.Tensor, activation: str = "silu", inplace_backward: bool = True) -> torch.Tensor:
    """``act(g) * u`` for ``activation`` in ("silu", "gelu", "gelu_tanh"); g and u share shape and dtype."""
    op = "glu"
    check_glu_inputs(op, g, u, activation)
    check_same_device(op, g=g, u=u)
    check_same_dtype(op, g=g, u=u)
    if not use_triton(g.device):
        return glu_reference(g, u, activation)
    inplace = bool(inplace_backward) and can_overwrite(g, u)
    if inplace:
        claim(g, u)
    return _GLUFunction.apply(g, u, activation, inplace)


def swiglu(g: torch.Tensor, u: torch.Tensor, inplace_backward: bool = True) -> torch.Tensor:
    """``silu(g) * u`` (the Llama/Mistral/Qwen MLP)."""
    return glu(g, u, "silu", inplace_backward)


def geglu(g: torch.Tensor, u: torch.Tensor, approximate: str = "none", inplace_backward: bool = True) -> torch.Tensor:
    """``gelu(g) * u`` with exact erf (``approximate="none"``) or the tanh form (``"tanh"``)."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"geglu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return glu(g, u, "gelu_tanh" if approximate == "tanh" else "gelu", inplace_backward)
