"""RMSNorm, forward and backward (input and weight gradients), with an optional fused residual add.

Three weight conventions, each matching HuggingFace bit for bit in its casting:
- ``mode="llama"``: normalise in fp32, cast to the input dtype, then multiply by ``weight``
  (the output dtype is the promotion of the input and weight dtypes, as in ``LlamaRMSNorm``).
- ``mode="gemma"``: normalise in fp32, multiply by ``1 + weight`` in fp32, cast to the input dtype.
- ``mode="olmo"``: normalise in fp32, multiply by ``weight`` in fp32, cast to the input dtype
  (``Olmo2RMSNorm``'s ``(weight * hidden).to(input_dtype)``: in bf16 the product is rounded once, not the
  normalised input first as in "llama"). Gemma 4's norms too (weights that start at 1; its norms without a
  scale with a ones weight).

With ``residual=r`` the op returns ``(rms_norm(x + r), x + r)``: the sum is rounded to the input dtype
first (as the HF decoder layer does) and both outputs are written in one pass.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from foak.backend import use_triton
from foak.ops._checks import check_float_tensor, check_same_device, check_same_dtype, rows_view
from foak.ops._custom_op import custom_op
from foak.ops._inplace import can_overwrite, claim, overwritten
from foak.ops._recompute import offer

MODES = ("llama", "gemma", "olmo")
MAX_HIDDEN = 65536
# Rows up to this many columns are held in registers (one pass over memory); wider rows are
# processed in chunks of _CHUNK columns with a second pass.
_MAX_SINGLE_BLOCK = 16384
_CHUNK = 4096
# Launch knobs (None = heuristic), swept on the GPU by benchmarks/tune_ops.py.
# Chosen on the H200 at [16384, 4096] bf16 (benchmarks/results/tune_h200.json): 2 backward programs per
# SM of 16 warps ran 0.203 ms fwd+bwd, 8 per SM 0.199 ms but with 4x the fp32 weight-grad partials.
TUNING = {"forward_warps": None, "backward_warps": None, "backward_programs_per_sm": 2}


# 1. reference -------------------------------------------------------------------------------------
def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    mode: str = "llama",
    residual: torch.Tensor | None = None,
):
    """The math in plain torch, with HF's casting. Returns y, or (y, x + residual)."""
    total = None
    if residual is not None:
        total = x + residual
        x = total
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if mode == "gemma":
        y = (h * (1.0 + weight.float())).to(x.dtype)
    elif mode == "olmo":
        y = (h * weight.float()).to(x.dtype)
    else:
        y = weight * h.to(x.dtype)
    return y if total is None else (y, total)


# 2. kernels ---------------------------------------------------------------------------------------
@triton.jit
def _rms_norm_forward_kernel(
    X, x_stride, R, r_stride, S, s_stride, Y, y_stride, W, RSTD,
    n_cols, eps,
    FP32_PRODUCT: tl.constexpr, PLUS_ONE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SINGLE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = X + row * x_stride
    r_row = R + row * r_stride
    s_row = S + row * s_stride
    y_row = Y + row * y_stride
    if SINGLE:
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(r_row + cols, mask=mask, other=0.0).to(tl.float32)
            # the sum is rounded to the input dtype, like the HF residual add, then normalised
            x = (x + r).to(S.dtype.element_ty)
            tl.store(s_row + cols, x, mask=mask)
            x = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if PLUS_ONE:
            w = 1.0 + w
        h = x * rstd
        if FP32_PRODUCT:
            y = h * w
        else:
            y = h.to(X.dtype.element_ty).to(tl.float32) * w
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            c = start + cols
            mask = c < n_cols
            x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(r_row + c, mask=mask, other=0.0).to(tl.float32)
                x = (x + r).to(S.dtype.element_ty)
                tl.store(s_row + c, x, mask=mask)
                x = x.to(tl.float32)
            acc += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / n_cols + eps)
        for start in range(0, n_cols, BLOCK):
            c = start + cols
            mask = c < n_cols
            if HAS_RESIDUAL:
                x = tl.load(s_row + c, mask=mask, other=0.0).to(tl.float32)
            else:
                x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
            if PLUS_ONE:
                w = 1.0 + w
            h = x * rstd
            if FP32_PRODUCT:
                y = h * w
            else:
                y = h.to(X.dtype.element_ty).to(tl.float32) * w
            tl.store(y_row + c, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _rms_norm_backward_kernel(
    DY, dy_stride, X, x_stride, W, RSTD, DS, ds_stride, DX, dx_stride, DW_PARTIAL,
    n_rows, n_cols, rows_per_program,
    FP32_PRODUCT: tl.constexpr, PLUS_ONE: tl.constexpr, HAS_DS: tl.constexpr, SINGLE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Each program owns a contiguous band of rows and one row of DW_PARTIAL (fp32), so the weight
    # gradient needs no atomics: the host sums the partial rows afterwards.
    # rows are first + i with first int64, so row * stride is 64-bit on the GPU and in the interpreter alike
    # (a row index taken from range() itself would be a Python int there, multiplied in int32)
    pid = tl.program_id(0).to(tl.int64)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK)
    dw_row = DW_PARTIAL + pid * n_cols
    if SINGLE:
        mask = cols < n_cols
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if PLUS_ONE:
            w = w + 1.0
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(0, last - first):
            row = first + i
            x = tl.load(X + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + row * dy_stride + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row)
            h = x * rstd
            if FP32_PRODUCT:
                dw += dy * h
            else:
                dw += dy * h.to(X.dtype.element_ty).to(tl.float32)
            g = dy * w
            dx = (g - h * (tl.sum(g * h, axis=0) / n_cols)) * rstd
            if HAS_DS:
                dx += tl.load(DS + row * ds_stride + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + row * dx_stride + cols, dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(dw_row + cols, dw, mask=mask)
    else:
        for i in range(0, last - first):
            row = first + i
            rstd = tl.load(RSTD + row)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK):
                c = start + cols
                mask = c < n_cols
                x = tl.load(X + row * x_stride + c, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + row * dy_stride + c, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
                if PLUS_ONE:
                    w = w + 1.0
                acc += dy * w * x
            mean_gh = tl.sum(acc, axis=0) * rstd / n_cols
            for start in range(0, n_cols, BLOCK):
                c = start + cols
                mask = c < n_cols
                x = tl.load(X + row * x_stride + c, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + row * dy_stride + c, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(W + c, mask=mask, other=0.0).to(tl.float32)
                if PLUS_ONE:
                    w = w + 1.0
                h = x * rstd
                dx = (dy * w - h * mean_gh) * rstd
                if HAS_DS:
                    dx += tl.load(DS + row * ds_stride + c, mask=mask, other=0.0).to(tl.float32)
                tl.store(DX + row * dx_stride + c, dx.to(DX.dtype.element_ty), mask=mask)
                # the partial row belongs to this program alone: read-modify-write is race free
                if FP32_PRODUCT:
                    contrib = dy * h
                else:
                    contrib = dy * h.to(X.dtype.element_ty).to(tl.float32)
                prev = tl.load(dw_row + c, mask=mask, other=0.0)
                tl.store(dw_row + c, prev + contrib, mask=mask)


# 3. launchers -------------------------------------------------------------------------------------
def _block_config(n_cols: int) -> tuple[bool, int, int]:
    block = triton.next_power_of_2(n_cols)
    single = block <= _MAX_SINGLE_BLOCK
    if not single:
        block = _CHUNK
    num_warps = min(32, max(4, block // 512))
    return single, block, num_warps


def _output_dtype(x: torch.Tensor, weight: torch.Tensor, mode: str) -> torch.dtype:
    return torch.promote_types(x.dtype, weight.dtype) if mode == "llama" else x.dtype


def _forward_launch(x, weight, residual, eps: float, mode: str):
    n_cols = x.shape[-1]
    x2 = rows_view(x, n_cols)
    n_rows = x2.shape[0]
    y = torch.empty((n_rows, n_cols), dtype=_output_dtype(x, weight, mode), device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if residual is not None:
        r2 = rows_view(residual, n_cols)
        total = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    else:
        r2 = total = x2  # unused by the kernel (HAS_RESIDUAL=False)
    single, block, num_warps = _block_config(n_cols)
    num_warps = TUNING["forward_warps"] or num_warps
    if n_rows > 0:
        _rms_norm_forward_kernel[(n_rows,)](
            x2, x2.stride(0), r2, r2.stride(0), total, total.stride(0), y, y.stride(0), weight, rstd,
            n_cols, eps,
            FP32_PRODUCT=mode != "llama", PLUS_ONE=mode == "gemma", HAS_RESIDUAL=residual is not None,
            SINGLE=single, BLOCK=block,
            num_warps=num_warps,
        )
    y = y.view(x.shape)
    if residual is None:
        return y, None, rstd
    return y, total.view(x.shape), rstd


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _num_programs(device: torch.device, n_rows: int) -> int:
    if device.type == "cuda":
        sms = _sm_count(device)
        return max(1, min(n_rows, TUNING["backward_programs_per_sm"] * sms))
    return max(1, min(n_rows, 8))  # the interpreter runs programs one by one


def _backward_launch(dy, x, weight, rstd, d_total, mode: str, dx=None):
    """dx may be x itself (contiguous): each row/chunk of x is read before its gradient overwrites it."""
    n_cols = x.shape[-1]
    x2 = rows_view(x, n_cols)
    dy2 = rows_view(dy, n_cols)
    n_rows = x2.shape[0]
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device) if dx is None else dx.view(n_rows, n_cols)
    ds2 = rows_view(d_total, n_cols) if d_total is not None else dy2
    single, block, num_warps = _block_config(n_cols)
    num_warps = TUNING["backward_warps"] or min(16, max(4, block // 256))
    programs = _num_programs(x.device, n_rows)
    rows_per_program = triton.cdiv(max(n_rows, 1), programs)
    programs = triton.cdiv(max(n_rows, 1), rows_per_program)
    alloc = torch.empty if single else torch.zeros
    dw_partial = alloc((programs, n_cols), dtype=torch.float32, device=x.device)
    if n_rows > 0:
        _rms_norm_backward_kernel[(programs,)](
            dy2, dy2.stride(0), x2, x2.stride(0), weight, rstd, ds2, ds2.stride(0), dx, dx.stride(0),
            dw_partial, n_rows, n_cols, rows_per_program,
            FP32_PRODUCT=mode != "llama", PLUS_ONE=mode == "gemma", HAS_DS=d_total is not None,
            SINGLE=single, BLOCK=block,
            num_warps=num_warps,
        )
    else:
        dw_partial.zero_()
    dw = dw_partial.sum(0).to(weight.dtype)
    return dx.view(x.shape), dw


# 4. custom ops (so torch.compile traces through) and autograd -------------------------------------
def _forward_fake(x, weight, residual, eps, mode):
    y = x.new_empty(x.shape, dtype=_output_dtype(x, weight, mode))
    total = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return y, total, x.new_empty(rows, dtype=torch.float32)


@custom_op("rms_norm_forward", _forward_fake)
def _forward_op(
    x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None, eps: float, mode: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, total, rstd = _forward_launch(x, weight, residual, eps, mode)
    # custom ops may not return None: without a residual the "sum" output is an empty tensor
    return y, (total if total is not None else x.new_empty(0)), rstd


def _backward_fake(dy, x, weight, rstd, d_total, mode):
    return x.new_empty(x.shape), torch.empty_like(weight)


@custom_op("rms_norm_backward", _backward_fake)
def _backward_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
    d_total: torch.Tensor | None, mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward_launch(dy, x, weight, rstd, d_total, mode)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, residual, eps, mode, inplace_backward):
        y, total, rstd = _forward_op(x, weight, residual, eps, mode)
        has_residual = residual is not None
        # backward needs the normalised input: the sum when a residual was fused in
        ctx.save_for_backward(total if has_residual else x, weight, rstd)
        ctx.mode = mode
        ctx.has_residual = has_residual
        ctx.inplace_backward = inplace_backward
        if has_residual:
            return y, total
        return y

    @staticmethod
    def backward(ctx, dy, d_total=None):
        # grads of unused outputs arrive as zeros (autograd materialises them), never None
        normed_input, weight, rstd = ctx.saved_tensors
        if ctx.inplace_backward:  # eager only (never chosen while compiling): dx into x's memory
            dx, dw = _backward_launch(dy, normed_input, weight, rstd, d_total, ctx.mode, dx=normed_input)
            overwritten(normed_input)
        else:
            dx, dw = _backward_op(dy, normed_input, weight, rstd, d_total, ctx.mode)
        if not ctx.needs_input_grad[1]:
            dw = None
        dres = dx if ctx.has_residual and ctx.needs_input_grad[2] else None
        return dx, dw, dres, None, None, None


# 5. public function -------------------------------------------------------------------------------
def _validate(x, weight, residual, eps, mode) -> None:
    op = "rms_norm"
    check_float_tensor(op, "x", x)
    check_float_tensor(op, "weight", weight)
    if mode not in MODES:
        raise ValueError(f"{op}: mode must be one of {MODES}, got {mode!r}")
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{op}: x must have a non-empty last dimension (the hidden size), got {tuple(x.shape)}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{op}: weight must be 1-D with the hidden size of x ({x.shape[-1]}), got shape {tuple(weight.shape)}"
        )
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"{op}: hidden size {x.shape[-1]} exceeds the supported maximum {MAX_HIDDEN}")
    if not isinstance(eps, (float, int)) or eps < 0:
        raise ValueError(f"{op}: eps must be a non-negative float, got {eps!r}")
    check_same_device(op, x=x, weight=weight, residual=residual)
    if residual is not None:
        check_float_tensor(op, "residual", residual)
        check_same_dtype(op, x=x, residual=residual)
        if residual.shape != x.shape:
            raise ValueError(
                f"{op}: residual has shape {tuple(residual.shape)}; expected the shape of x {tuple(x.shape)}"
            )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    mode: str = "llama",
    residual: torch.Tensor | None = None,
    inplace_backward: bool = True,
):
    """RMSNorm over the last dimension of ``x`` (any number of leading dims, hidden size <= 65536).

    Returns ``y``; with ``residual`` given, returns ``(y, x + residual)`` where ``y`` normalises the sum.
    When ``x`` is an intermediate (not a leaf, not a view) and no residual is fused, the backward writes
    dx into x's memory (see ``foak/ops/_inplace.py``); ``inplace_backward=False`` keeps x intact.
    """
    _validate(x, weight, residual, eps, mode)
    if not use_triton(x.device):
        return rms_norm_reference(x, weight, eps, mode, residual)
    inplace = bool(inplace_backward) and residual is None and can_overwrite(x)
    if inplace:
        claim(x)
    out = _RMSNormFunction.apply(x, weight, residual, float(eps), mode, inplace)
    if residual is None:
        # x, weight (and rstd) are kept for this op's backward anyway: inside a
        # foak.ops._recompute.recomputing_outputs() scope, consumers that save y save this recipe instead
        offer(out, functools.partial(_recompute_output, eps=float(eps), mode=mode), x, weight)
    return out


def _recompute_output(x, weight, eps, mode):
    return _forward_launch(x, weight, None, eps, mode)[0]
