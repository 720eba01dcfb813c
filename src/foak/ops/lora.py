"""LoRA on a frozen linear base: ``y = x W^T + b + s * dropout(x) A^T B^T``, forward and backward.

The math is PEFT's ``lora.Linear.forward`` for one active adapter (peft 0.21): the base result is
``F.linear(x, W, b)``; the adapter input is ``x`` cast to ``lora_A``'s dtype, then dropped out (inverted
dropout: kept with probability ``1 - p``, kept values scaled by ``1 / (1 - p)``); the adapter output
``lora_B(lora_A(.)) * s`` is added and the sum is cast back to the base result's dtype. Under autocast
every GEMM runs in the autocast dtype, as PEFT's ``nn.Linear`` calls do, and the adapter gradients are
cast back to the adapters' own dtype (fp32 adapters get fp32 gradients). ``s`` is PEFT's ``scaling``:
``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA. The base is frozen: no gradient for W or b.

What is saved for the backward: ``x`` and the small ``[tokens, r]`` product ``h = dropout(x) A^T``,
never ``dropout(x)`` nor its mask. The mask comes from a counter-based generator (Philox-4x32-10, as
``tl.randint4x``) keyed by a seed and by each element's position, so the backward regenerates it
exactly. Element ``(t, j)`` of the flattened ``[tokens, in]`` input is kept iff
``(philox(seed, t * ceil(in / 4) + j // 4)[j % 4] >> 1) >= round(p * 2**31)``: the mask depends on the
seed and the shape only, not on block sizes or devices (:func:`lora_dropout_mask` returns it; the torch
reference computes the same bits). ``dropout_p=0`` launches no kernel.

GEMMs are cuBLAS's. The rank-sized up-projection ``s * h B^T`` writes the output first and the base GEMM
accumulates onto it (beta=1: read in the GEMM's epilogue, no separate pass over the output). In the
backward ``dx = dy W + s * mask / (1 - p) * ((dy B) A)`` likewise: the adapter's part (``(dy B) A``, and
with dropout one elementwise kernel applying the regenerated mask) first, then the base GEMM onto it;
``dA = s * (dy B)^T dropout(x)`` (the mask regenerated once more), ``dB = s * dy^T h``. Under a dtype
mismatch (fp32 adapters on a bf16 base outside autocast) the sums are formed as PEFT forms them.

A quantized base under autocast is PEFT's ``lora.bnb.Linear4bit`` over bitsandbytes' ``Linear4bit``, which
is no autocast op: it casts x to its compute dtype (the autocast dtype) and returns its result in x's
dtype, and PEFT casts the adapter's output to that dtype and adds it there. So with an fp32 x (the
fp32 norms of ``prepare_model_for_kbit_training``) the output is fp32: x is cast once inside the op (and
saved in the compute dtype), the base GEMM's result and ``(h B^T) * s`` are each rounded to the compute
dtype and then summed in x's dtype; the backward casts dy to the compute dtype, scales it before the
adapter's GEMMs, and sums the base's and the adapter's input-gradient parts in x's dtype (no
accumulation in a GEMM's epilogue on this path). These are the operations autograd runs for PEFT's
layer, so the values are the same.

:func:`lora_linears` is the shared-input form of an attention block (q, k, v projections of one x):
x goes to one autograd op, is saved once, and each projection keeps its own mask (PEFT draws one per
projection). Without dropout the down-projections run as one GEMM on the stacked ``[sum r, in]`` A's.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from foak.backend import use_triton
from foak.ops import lowrank as lowrank_mod
from foak.ops._checks import check_float_tensor, check_same_device, rows_view
from foak.ops._custom_op import custom_op
from foak.ops._philox_mask import drop_threshold, keep_mask_row
from foak.ops.lowrank import SIXTEEN_BIT, lowrank_add_, lowrank_down, lowrank_tokens

# Launch knobs: quads of 4 columns per program (one Philox call makes the 4 randoms of a quad).
TUNING = {"quads": 256, "warps": 4}
SEED_HIGH = 2**62  # seeds are drawn from [0, SEED_HIGH)
_M32 = 0xFFFFFFFF
# Philox-4x32 constants, as triton.language.random (the reference must produce the same bits)
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_ROUNDS = 10


# seeds and thresholds ---------------------------------------------------------------------------
def lora_dropout_seed(device: torch.device | str) -> torch.Tensor:
    """A fresh dropout seed: one int64 drawn from torch's generator of ``device`` (so
    ``torch.manual_seed`` makes runs reproducible), kept on the device (no host sync). This is the
    draw :func:`lora_linear` makes when called with ``seed=None`` and ``dropout_p > 0``."""
    return torch.randint(0, SEED_HIGH, (1,), dtype=torch.int64, device=device)


def _seed_tensor(op: str, seed, device: torch.device) -> torch.Tensor:
    if seed is None:
        return lora_dropout_seed(device)
    if isinstance(seed, torch.Tensor):
        other_device = seed.device.type != device.type or (
            device.index is not None and seed.device.index != device.index)
        if seed.numel() != 1 or seed.dtype not in (torch.int64, torch.int32) or other_device:
            raise ValueError(f"{op}: seed must be an int or a one-element int64 tensor on {device}; got "
                             f"{seed.dtype} of shape {tuple(seed.shape)} on {seed.device}")
        return seed.reshape(1).to(torch.int64)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= int(seed) < 2**63:
        raise ValueError(f"{op}: seed must be an int in [0, 2**63) or None; got {seed!r}")
    return torch.tensor([int(seed)], dtype=torch.int64, device=device)


# 1. reference -------------------------------------------------------------------------------------
def _mul32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``a * b`` for a 32-bit constant ``a`` and int64 ``b`` in [0, 2**32),
    without overflowing int64 (b split in 16-bit halves)."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    part_hi, part_lo = a * b_hi, a * b_lo  # < 2**48 each
    return (part_hi + (part_lo >> 16)) >> 16, (((part_hi & 0xFFFF) << 16) + part_lo) & _M32


def _philox_reference(seed: torch.Tensor, counter: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Philox-4x32-10 of (counter_lo, counter_hi, 0, 0) keyed by the seed, in int64 torch arithmetic:
    the same four 32-bit words as ``tl.randint4x(seed, counter)``."""
    c0, c1 = counter & _M32, (counter >> 32) & _M32
    c2 = c3 = torch.zeros_like(counter)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(_PHILOX_ROUNDS):
        hi_b, lo_b = _mul32(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul32(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY_A) & _M32, (k1 + _PHILOX_KEY_B) & _M32
    return c0, c1, c2, c3


def lora_dropout_mask_reference(seed: torch.Tensor, n_rows: int, n_cols: int, p: float) -> torch.Tensor:
    """The [n_rows, n_cols] keep mask (bool) in plain torch, bit-identical to the kernels'."""
    seed = seed.reshape(1).to(torch.int64)
    n_quads = triton.cdiv(n_cols, 4)
    rows = torch.arange(n_rows, dtype=torch.int64, device=seed.device)[:, None]
    counter = rows * n_quads + torch.arange(n_quads, dtype=torch.int64, device=seed.device)[None, :]
    words = torch.stack(_philox_reference(seed, counter), dim=-1).reshape(n_rows, 4 * n_quads)
    return (words[:, :n_cols] >> 1) >= drop_threshold(p)


def _dropout_reference(xa: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    keep = lora_dropout_mask_reference(seed, xa.numel() // max(xa.shape[-1], 1), xa.shape[-1], p)
    return torch.where(keep.view(xa.shape), xa * (1.0 / (1.0 - p)), torch.zeros((), dtype=xa.dtype))


def lora_linear_reference(x, weight, bias, lora_A, lora_B, scaling, dropout_p=0.0, seed=None, result_dtype=None):
    """PEFT's lora.Linear forward in plain torch (autocast applies to its F.linear calls as in PEFT);
    the dropout mask is :func:`lora_dropout_mask`'s for ``seed`` (drawn if None). A quantized ``weight``
    is dequantized to x's dtype. With ``result_dtype`` (a quantized base under autocast; x arrives in it)
    the sums are PEFT's ``lora.bnb.Linear4bit``'s: x is cast to the weight's compute dtype for the base
    GEMM, whose result is cast back to ``result_dtype`` (as bitsandbytes' ``Linear4bit`` returns it), and
    the adapter's output ``lora_B(lora_A(.)) * scaling`` (compute dtype) is cast to it and added there."""
    if result_dtype is not None:
        result = torch.nn.functional.linear(x.to(weight.dtype), _dense(weight, weight.dtype), bias).to(result_dtype)
    else:
        result = torch.nn.functional.linear(x, _dense(weight, x.dtype), bias)
    xa = x.to(lora_A.dtype)
    if dropout_p > 0:
        xa = _dropout_reference(xa, _seed_tensor("lora_linear_reference", seed, x.device), dropout_p)
    adapter = torch.nn.functional.linear(torch.nn.functional.linear(xa, lora_A), lora_B)
    if result_dtype is not None:
        return result + (adapter * scaling).to(result_dtype)
    return (result + adapter * scaling).to(result.dtype)


def lora_linears_reference(x, projections, result_dtype=None):
    """:func:`lora_linear_reference` for each ``(weight, bias, lora_A, lora_B, scaling, dropout_p, seed)``."""
    return tuple(lora_linear_reference(x, *proj, result_dtype=result_dtype) for proj in projections)


# quantized bases ----------------------------------------------------------------------------------
# A frozen base weight is a dense tensor or a quantized one: any object with ``shape`` ([out, in]),
# ``device``, ``dtype`` (its compute dtype), ``requires_grad`` (False) and ``dequantize(dtype)``
# returning a fresh dense [out, in] tensor (foak.ops.nf4.NF4Weight). A quantized weight is dequantized
# for each GEMM that needs it (forward, and again for the input gradient) and the dense copy is freed
# right after: no dense copy lives from the forward to the backward.
def _is_quantized(weight) -> bool:
    return not isinstance(weight, torch.Tensor)


def _dense(weight, dtype: torch.dtype) -> torch.Tensor:
    return weight if isinstance(weight, torch.Tensor) else weight.dequantize(dtype)


def _check_quantized(op: str, weight) -> None:
    missing = [a for a in ("shape", "device", "dtype", "dequantize") if not hasattr(weight, a)]
    if missing or len(weight.shape) != 2:
        raise ValueError(f"{op}: weight must be a torch.Tensor or a quantized weight with shape [out, in], "
                         f"device, dtype and dequantize(dtype) (e.g. foak.ops.nf4.NF4Weight); got "
                         f"{type(weight).__name__}" + (f" without {missing}" if missing else ""))
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{op}: the quantized weight's compute dtype must be float32, bfloat16 or float16; "
                         f"got {weight.dtype}")


# 2. kernels ---------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["threshold"])
def _dropout_forward_kernel(X, x_stride, OUT, out_stride, SEED, n_cols, n_quads, threshold, scale,
                            QUADS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    quads = tl.program_id(1) * QUADS + tl.arange(0, QUADS)
    cols = quads[:, None] * 4 + tl.arange(0, 4)[None, :]
    in_row = cols < n_cols
    keep = keep_mask_row(tl.load(SEED), row, quads, n_quads, threshold)
    x = tl.load(X + row * x_stride + cols, mask=in_row, other=0.0).to(tl.float32)
    tl.store(OUT + row * out_stride + cols, tl.where(keep, x * scale, 0.0).to(OUT.dtype.element_ty), mask=in_row)


@triton.jit(do_not_specialize=["threshold"])
def _dropout_backward_kernel(X, x_stride, DXA, DX, SEED, n_cols, n_quads, threshold, scale,
                             STORE_XD: tl.constexpr, QUADS: tl.constexpr):
    # DX += mask * scale * DXA; with STORE_XD, DXA is then overwritten by dropout(X) (same mask).
    # DXA and DX are contiguous [rows, n_cols]; each element is read before it is written.
    row = tl.program_id(0).to(tl.int64)
    quads = tl.program_id(1) * QUADS + tl.arange(0, QUADS)
    cols = quads[:, None] * 4 + tl.arange(0, 4)[None, :]
    in_row = cols < n_cols
    keep = keep_mask_row(tl.load(SEED), row, quads, n_quads, threshold)
    offs = row * n_cols + cols
    dxa = tl.load(DXA + offs, mask=in_row, other=0.0).to(tl.float32)
    dx = tl.load(DX + offs, mask=in_row, other=0.0).to(tl.float32)
    tl.store(DX + offs, (dx + tl.where(keep, dxa * scale, 0.0)).to(DX.dtype.element_ty), mask=in_row)
    if STORE_XD:
        x = tl.load(X + row * x_stride + cols, mask=in_row, other=0.0).to(tl.float32)
        tl.store(DXA + offs, tl.where(keep, x * scale, 0.0).to(DXA.dtype.element_ty), mask=in_row)


# 3. launchers -------------------------------------------------------------------------------------
def _launch_config(n_rows: int, n_cols: int):
    n_quads = triton.cdiv(n_cols, 4)
    quads = min(TUNING["quads"], triton.next_power_of_2(n_quads))
    return n_quads, quads, (n_rows, triton.cdiv(n_quads, quads))


def _dropout_forward_launch(x2d: torch.Tensor, seed: torch.Tensor, p: float, out: torch.Tensor) -> None:
    n_rows, n_cols = x2d.shape
    if x2d.numel() == 0:
        return
    n_quads, quads, grid = _launch_config(n_rows, n_cols)
    _dropout_forward_kernel[grid](x2d, x2d.stride(0), out, out.stride(0), seed, n_cols, n_quads,
                                  drop_threshold(p), 1.0 / (1.0 - p), QUADS=quads, num_warps=TUNING["warps"])


def _dropout_backward_launch(x2d, dxa, dx, seed, p: float, store_xd: bool) -> None:
    n_rows, n_cols = x2d.shape
    if x2d.numel() == 0:
        return
    n_quads, quads, grid = _launch_config(n_rows, n_cols)
    _dropout_backward_kernel[grid](x2d, x2d.stride(0), dxa, dx, seed, n_cols, n_quads, drop_threshold(p),
                                   1.0 / (1.0 - p), STORE_XD=store_xd, QUADS=quads, num_warps=TUNING["warps"])


# 4. custom ops and autograd ----------------------------------------------------------------------
def _dropout_fake(x2d, seed, p, dtype):
    return x2d.new_empty(x2d.shape, dtype=dtype)


@custom_op("lora_dropout", _dropout_fake)
def _dropout_op(x2d: torch.Tensor, seed: torch.Tensor, p: float, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(x2d.shape, dtype=dtype, device=x2d.device)
    _dropout_forward_launch(x2d, seed, p, out)
    return out


def _dropout_backward_fake(x2d, dxa, dx, seed, p, store_xd):
    return None


@custom_op("lora_dropout_backward", _dropout_backward_fake, mutates_args=("dxa", "dx"))
def _dropout_backward_op(x2d: torch.Tensor, dxa: torch.Tensor, dx: torch.Tensor, seed: torch.Tensor, p: float,
                         store_xd: bool) -> None:
    _dropout_backward_launch(x2d, dxa, dx, seed, p, store_xd)


def _mixed(big: torch.Tensor, adapter: torch.Tensor) -> bool:
    """fp32 adapters with a 16-bit operand (a bf16 base outside autocast): the adapter's products are formed in
    fp32 by foak.ops.lowrank's kernels, which read the operand in its own dtype (no fp32 copy of it), on the
    devices of ``foak.ops.lowrank.USE``."""
    return _mixed_dtypes(big.dtype, adapter, big.device)


def _mixed_dtypes(dtype: torch.dtype, adapter: torch.Tensor, device: torch.device) -> bool:
    return dtype in SIXTEEN_BIT and adapter.dtype == torch.float32 and lowrank_mod.USE.get(device.type, False)


def _keep(seed, p):
    """foak.ops.lowrank's ``keep`` argument: this op's dropout mask (None without dropout)."""
    return (seed, p) if p > 0 else None


def _down_projection(x2d, lora_A, p, seed):
    """``dropout(x cast to the adapters' dtype) A^T``, the saved [tokens, r] product."""
    if _mixed(x2d, lora_A):
        return lowrank_down(x2d, lora_A, keep=_keep(seed, p))
    return torch.mm(_adapter_input(x2d, lora_A.dtype, p, seed), lora_A.t())


def _adapter_output_grads(dy, h, lora_B, scaling, need_B, need_g=True):
    """``(dB, g) = (s dy^T h, s dy B)`` in the adapters' dtype (g: the gradient of h); None where not needed."""
    if _mixed(dy, lora_B):
        return (lowrank_tokens(dy, h, scaling) if need_B else None,
                lowrank_down(dy, lora_B.t(), scaling) if need_g else None)
    dy_a = dy if dy.dtype == lora_B.dtype else dy.to(lora_B.dtype)
    return (_scaled(torch.mm(dy_a.t(), h), scaling) if need_B else None,
            _scaled(torch.mm(dy_a, lora_B), scaling) if need_g else None)


def _down_weight_grad(g, x2d, lora_A, p, seed, xa=None):
    """``dA = g^T dropout(x cast to the adapters' dtype)``; ``xa``: that input when the caller has it."""
    if xa is None:
        if _mixed(x2d, lora_A):
            return lowrank_tokens(x2d, g, keep=_keep(seed, p)).t().contiguous()
        xa = (_dropout_op(x2d, seed, p, lora_A.dtype) if p > 0
              else x2d if x2d.dtype == lora_A.dtype else x2d.to(lora_A.dtype))
    return torch.mm(g.t(), xa)


def _adapter_input(x2d, dtype, p, seed):
    """dropout(x cast to the adapter dtype) as PEFT forms it (a fresh tensor only when p > 0 or a cast)."""
    if p > 0:
        return _dropout_op(x2d, seed, p, dtype)
    return x2d if x2d.dtype == dtype else x2d.to(dtype)


def _add_up_projection(out, h, lora_B, scaling):
    """out + scaling * h B^T, summed in the promoted dtype as PEFT's ``result + lora(x) * scaling`` and
    rounded to out's dtype. For a bf16 base with fp32 adapters the in-place add computes in fp32 and
    writes bf16 (no fp32 copy of the output: 12 instead of 20 bytes moved per output element)."""
    if h.dtype == out.dtype:
        return out.addmm_(h, lora_B.t(), alpha=scaling)
    if _mixed(out, lora_B):
        return lowrank_add_(out, h, lora_B, scaling)
    return out.add_(torch.mm(h, lora_B.t()), alpha=scaling)


def _projection_output(x2d, weight, bias, h, lora_B, scaling, out=None):
    """``x W^T + b + scaling * h B^T``. When h has x's dtype (under autocast, or one dtype throughout) the
    rank-sized GEMM writes the output first and the base GEMM accumulates into it (beta=1: cuBLAS reads it
    in its epilogue, so no separate read-modify-write pass over the output); otherwise the sum is formed in
    the promoted dtype as PEFT's ``result + lora(x) * scaling``."""
    if h.dtype == x2d.dtype and lora_B.dtype == x2d.dtype:
        hs = h if scaling == 1.0 else h * scaling  # [tokens, r]
        res = torch.mm(hs, lora_B.t(), out=out) if bias is None else torch.addmm(bias, hs, lora_B.t(), out=out)
        return res.addmm_(x2d, _dense(weight, x2d.dtype).t())
    res = _add_up_projection(_base(x2d, weight, bias), h, lora_B, scaling)
    if out is not None:
        return out.copy_(res)
    return res


def _split_output(x_c, weight, bias, h, lora_B, scaling, out):
    """``out = (x W^T + b) + (h B^T) * scaling`` with each GEMM's result rounded to the compute dtype (x_c's)
    and the two summed in ``out``'s dtype (x's before the cast): a quantized base under autocast, summed as
    bitsandbytes' ``Linear4bit`` and PEFT's ``lora.bnb.Linear4bit`` sum it (no accumulation in the GEMM)."""
    adapter = _scaled(torch.mm(h, lora_B.t()), scaling)
    if out.dtype == x_c.dtype:
        _base(x_c, weight, bias, out=out)
    else:
        out.copy_(_base(x_c, weight, bias))
    return out.add_(adapter)


def _split_backward(x_c, dout, weight, lora_A, lora_B, h, seed, scaling, p, need_x, need_A, need_B, dx=None):
    """(dx, dA, dB) of a projection whose output :func:`_split_output` formed, as autograd runs PEFT's: the
    gradient is cast to the compute dtype, scaled before the adapter's GEMMs (PEFT's ``* scaling`` follows
    lora_B), and the input gradients of the base and of the adapter (each a compute-dtype GEMM) are summed in
    dout's dtype, into ``dx`` when given."""
    compute = weight.dtype
    dy = dout if dout.dtype == compute else dout.to(compute)
    dy_s = dy if scaling == 1.0 else dy * scaling
    dB = torch.mm(dy_s.t(), h) if need_B else None
    dA = None
    if need_x or need_A:
        g = torch.mm(dy_s, lora_B)
        xa = None
        if need_x:
            # the adapter's part in the compute dtype, masked there (its forward dropped out x cast to it)
            dx_a, xa = _adapter_input_grad(None, g, lora_A, x_c, seed, p, compute, need_A)
            dx_b = torch.mm(dy, _dense(weight, compute))
            if dx is None:
                dx = dx_a if dx_a.dtype == dout.dtype else dx_a.to(dout.dtype)
                dx.add_(dx_b)
            else:
                dx.add_(dx_a).add_(dx_b)
        if need_A:
            if xa is None:
                xa = (_dropout_op(x_c, seed, p, lora_A.dtype) if p > 0
                      else x_c if x_c.dtype == lora_A.dtype else x_c.to(lora_A.dtype))
            dA = torch.mm(g.t(), xa)
    return dx, dA, dB


def _base(x2d, weight, bias, out=None):
    w = _dense(weight, x2d.dtype)
    return torch.mm(x2d, w.t(), out=out) if bias is None else torch.addmm(bias, x2d, w.t(), out=out)


def _add_input_grad_base(dx, dys, weights):
    """dx += sum_i dy_i W_i (dx None: a new tensor); each base GEMM accumulates in its epilogue."""
    for dy, weight in zip(dys, weights):
        w = _dense(weight, dy.dtype)
        dx = torch.mm(dy, w) if dx is None else dx.addmm_(dy, w)
    return dx


def _adapter_input_grad(dx, g, lora_A, x2d, seed, p, dtype, want_xd):
    """dx += mask / (1 - p) * (g A) (dx None: a new tensor of ``dtype``). Returns (dx, dropout(x) or None):
    with ``want_xd`` and p > 0 the dropped-out input for dA, regenerated from the seed (not with fp32 adapters
    on a 16-bit dx: :func:`_down_weight_grad` applies the mask itself there)."""
    if _mixed_dtypes(dtype if dx is None else dx.dtype, lora_A, g.device):
        if dx is None:
            dx = g.new_empty((g.shape[0], lora_A.shape[1]), dtype=dtype)
            return lowrank_add_(dx, g, lora_A.t(), accumulate=False, keep=_keep(seed, p)), None
        return lowrank_add_(dx, g, lora_A.t(), keep=_keep(seed, p)), None
    if p == 0:
        if dx is not None:
            _add_down_grad(dx, g, lora_A)
            return dx, None
        dxa = torch.mm(g, lora_A)
        return (dxa if dxa.dtype == dtype else dxa.to(dtype)), None
    dxa = torch.mm(g, lora_A)
    if dx is not None:
        _dropout_backward_op(x2d, dxa, dx, seed, p, want_xd)  # dxa then holds dropout(x) when want_xd
        return dx, (dxa if want_xd else None)
    dx = _dropout_op(dxa, seed, p, dtype)  # the mask applies to g A as to x: same positions
    del dxa
    return dx, (_dropout_op(x2d, seed, p, lora_A.dtype) if want_xd else None)


def _saveable(tensors):
    """(tensors with each quantized weight replaced by None, {position: quantized weight})."""
    quantized = {i: t for i, t in enumerate(tensors) if t is not None and _is_quantized(t)}
    return [None if i in quantized else t for i, t in enumerate(tensors)], quantized


def _restore(saved, quantized):
    return [quantized.get(i, t) for i, t in enumerate(saved)]


def _scaled(t, scaling):
    """t * scaling in place (no kernel for the usual scaling 1, lora_alpha == r)."""
    return t if scaling == 1.0 else t.mul_(scaling)


def _add_down_grad(dx, g, lora_A):
    """dx += g A (no dropout)."""
    if dx.dtype == lora_A.dtype:
        dx.addmm_(g, lora_A)
    else:
        dx.add_(torch.mm(g, lora_A))


def _compute_input(x2d, weight, split: bool):
    """x in the base's compute dtype: cast here (saved once) for a quantized base under autocast."""
    return x2d.to(weight.dtype) if split and x2d.dtype != weight.dtype else x2d


class _LoRALinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, lora_A, lora_B, scaling, dropout_p, seed, result_dtype):
        # result_dtype (a quantized base under autocast): x2d is in it and the output too (_split_output)
        split = result_dtype is not None
        x_c = _compute_input(x2d, weight, split)
        h = _down_projection(x_c, lora_A, dropout_p, seed)
        if split:
            out = _split_output(x_c, weight, bias, h, lora_B, scaling,
                                x_c.new_empty((x_c.shape[0], weight.shape[0]), dtype=result_dtype))
        else:
            out = _projection_output(x_c, weight, bias, h, lora_B, scaling)
        saved, ctx.quantized = _saveable([x_c, weight, lora_A, lora_B, h, seed])
        ctx.save_for_backward(*saved)
        ctx.scaling, ctx.dropout_p, ctx.split = scaling, dropout_p, split
        return out

    @staticmethod
    def backward(ctx, dout):
        x_c, weight, lora_A, lora_B, h, seed = _restore(ctx.saved_tensors, ctx.quantized)
        need_x, need_A, need_B = ctx.needs_input_grad[0], ctx.needs_input_grad[3], ctx.needs_input_grad[4]
        backward = _split_backward if ctx.split else _projection_backward
        with torch.autocast(dout.device.type, enabled=False):  # a backward run inside an autocast region
            dx, dA, dB = backward(x_c, dout, weight, lora_A, lora_B, h, seed, ctx.scaling, ctx.dropout_p, need_x,
                                  need_A, need_B)
        return dx, None, None, dA, dB, None, None, None, None


def _projection_backward(x2d, dout, weight, lora_A, lora_B, h, seed, scaling, p, need_x, need_A, need_B,
                         dx=None, base=True):
    """(dx, dA, dB) of one projection. The adapter's part of dx comes first and the base GEMM accumulates
    onto it (``base=False``: the caller adds the base part); with ``dx`` given, it is accumulated into it."""
    # g: the gradient of h (scaling included)
    dB, g = _adapter_output_grads(dout, h, lora_B, scaling, need_B, need_x or need_A)
    dA = None
    if need_x or need_A:
        xa = None
        if need_x:
            dx, xa = _adapter_input_grad(dx, g, lora_A, x2d, seed, p, dout.dtype, need_A)
            if base:
                dx = _add_input_grad_base(dx, [dout], [weight])
        if need_A:
            dA = _down_weight_grad(g, x2d, lora_A, p, seed, xa)
    elif need_x and base:
        dx = _add_input_grad_base(dx, [dout], [weight])
    return dx, dA, dB


class _LoRALinearsFunction(torch.autograd.Function):
    """Several projections of one input (q, k, v): x saved once, one input gradient."""

    @staticmethod
    def forward(ctx, x2d, meta, *tensors):
        # meta: (has_bias per projection, scalings, dropout_ps, stacked, lead, result_dtype); tensors: per
        # projection weight, bias (absent when None), lora_A, lora_B, seed (absent when p == 0).
        # result_dtype (quantized bases under autocast): x2d is in it and the outputs too (_split_output)
        projections = _unflatten(meta, tensors)
        _, scalings, dropout_ps, stacked, lead, result_dtype = meta
        x2d = _compute_input(x2d, projections[0][0], result_dtype is not None)
        outs, hs = [], []
        if stacked:
            # one down-projection GEMM for all adapters (no dropout, one adapter dtype)
            a_all = torch.cat([proj[2] for proj in projections])
            h_all = _down_projection(x2d, a_all, 0.0, None)
            hs = list(torch.split(h_all, [proj[2].shape[0] for proj in projections], dim=1))
        else:
            for (weight, bias, lora_A, lora_B, seed), p in zip(projections, dropout_ps):
                hs.append(_down_projection(x2d, lora_A, p, seed))
        for (weight, bias, lora_A, lora_B, seed), h, s in zip(projections, hs, scalings):
            # each output is allocated in its final shape, so that it is not a view (a consumer may then
            # reuse its memory for its gradient: foak.ops._inplace)
            out = x2d.new_empty((*lead, weight.shape[0]), dtype=result_dtype)
            if result_dtype is not None:
                _split_output(x2d, weight, bias, h, lora_B, s, out.view(-1, weight.shape[0]))
            else:
                _projection_output(x2d, weight, bias, h, lora_B, s, out=out.view(-1, weight.shape[0]))
            outs.append(out)
        ctx.meta = meta
        saved, ctx.quantized = _saveable(list(tensors))
        ctx.save_for_backward(x2d, *([h_all] if stacked else hs), *saved)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *douts):
        with torch.autocast(douts[0].device.type, enabled=False):  # a backward run inside an autocast region
            return _LoRALinearsFunction._backward(ctx, douts)

    @staticmethod
    def _backward(ctx, douts):
        _, scalings, dropout_ps, stacked, _, result_dtype = ctx.meta
        n = len(scalings)
        saved = ctx.saved_tensors
        x2d = saved[0]
        n_h = 1 if stacked else n
        tensors = _restore(saved[1 + n_h:], ctx.quantized)
        douts = [dy.reshape(-1, dy.shape[-1]) for dy in douts]
        projections = _unflatten(ctx.meta, tensors)
        need_x = ctx.needs_input_grad[0]
        flags = _needs_per_projection(ctx.meta, ctx.needs_input_grad[2:])
        dx = None  # the adapters' parts first, then every base GEMM accumulates onto them
        grads_A, grads_B = [], []
        if result_dtype is not None:  # quantized bases under autocast: PEFT's sums, per projection
            hs = torch.split(saved[1], [proj[2].shape[0] for proj in projections], dim=1) if stacked else saved[1:1 + n]
            for (weight, bias, lora_A, lora_B, seed), dy, h, s, p, (need_A, need_B) in zip(
                    projections, douts, hs, scalings, dropout_ps, flags):
                dx, dA, dB = _split_backward(x2d, dy, weight, lora_A, lora_B, h, seed, s, p, need_x, need_A, need_B,
                                             dx=dx)
                grads_A.append(dA)
                grads_B.append(dB)
        elif stacked:
            h_all = saved[1]
            hs = torch.split(h_all, [proj[2].shape[0] for proj in projections], dim=1)
            gs = []
            for (weight, bias, lora_A, lora_B, seed), dy, h, s, (need_A, need_B) in zip(
                    projections, douts, hs, scalings, flags):
                dB, g = _adapter_output_grads(dy, h, lora_B, s, need_B)
                grads_B.append(dB)
                gs.append(g)
            g_all = torch.cat(gs, dim=1)
            a_all = torch.cat([proj[2] for proj in projections])
            if need_x:
                dx, _ = _adapter_input_grad(None, g_all, a_all, x2d, None, 0.0, douts[0].dtype, False)
            if any(need_A for need_A, _ in flags):
                dA_all = _down_weight_grad(g_all, x2d, a_all, 0.0, None)
                grads_A = [dA if need_A else None for dA, (need_A, _) in
                           zip(torch.split(dA_all, [proj[2].shape[0] for proj in projections]), flags)]
            else:
                grads_A = [None] * n
        else:
            for (weight, bias, lora_A, lora_B, seed), dy, h, s, p, (need_A, need_B) in zip(
                    projections, douts, saved[1:1 + n], scalings, dropout_ps, flags):
                dx, dA, dB = _projection_backward(x2d, dy, weight, lora_A, lora_B, h, seed, s, p, need_x, need_A,
                                                  need_B, dx=dx, base=False)
                grads_A.append(dA)
                grads_B.append(dB)
        if need_x and result_dtype is None:
            dx = _add_input_grad_base(dx, douts, [proj[0] for proj in projections])
        grads = []
        for (weight, bias, lora_A, lora_B, seed), dA, dB in zip(projections, grads_A, grads_B):
            grads += [None] + ([None] if bias is not None else []) + [dA, dB] + ([None] if seed is not None else [])
        return (dx, None, *grads)


def _unflatten(meta, tensors):
    has_bias, dropout_ps = meta[0], meta[2]
    projections, i = [], 0
    for bias_present, p in zip(has_bias, dropout_ps):
        weight = tensors[i]
        i += 1
        bias = None
        if bias_present:
            bias = tensors[i]
            i += 1
        lora_A, lora_B = tensors[i], tensors[i + 1]
        i += 2
        seed = None
        if p > 0:
            seed = tensors[i]
            i += 1
        projections.append((weight, bias, lora_A, lora_B, seed))
    return projections


def _needs_per_projection(meta, needs):
    has_bias, dropout_ps = meta[0], meta[2]
    flags, i = [], 0
    for bias_present, p in zip(has_bias, dropout_ps):
        i += 1 + int(bias_present)
        flags.append((needs[i], needs[i + 1]))
        i += 2 + int(p > 0)
    return flags


# 5. public functions ------------------------------------------------------------------------------
def _check_number(op, name, value, low, high=None, high_open=False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{op}: {name} must be a finite real number, got {value!r}")
    if value < low or (high is not None and (value >= high if high_open else value > high)):
        bound = f"[{low}, {high})" if high_open else f">= {low}"
        raise ValueError(f"{op}: {name} must be in {bound}, got {value!r}")
    return float(value)


def _prepare_projection(op, x, weight, bias, lora_A, lora_B, scaling, dropout_p):
    """Validate one projection and apply autocast's casts (differentiable, outside the autograd
    Function) as the nn.Linear calls of PEFT would. Returns the tensors in compute dtypes, and the
    result dtype of a quantized base under autocast (x's, with x itself: the op casts it; else None)."""
    quantized = _is_quantized(weight)
    result_dtype = None
    if quantized:
        _check_quantized(op, weight)
    for name, t in (("x", x), ("weight", weight), ("lora_A", lora_A), ("lora_B", lora_B)):
        if not (name == "weight" and quantized):
            check_float_tensor(op, name, t)
    if bias is not None:
        check_float_tensor(op, "bias", bias)
    check_same_device(op, x=x, weight=weight, bias=bias, lora_A=lora_A, lora_B=lora_B)
    if x.dim() < 1:
        raise ValueError(f"{op}: x must be [..., in_features], got a 0-d tensor")
    in_features = x.shape[-1]
    if len(weight.shape) != 2 or weight.shape[1] != in_features:
        raise ValueError(f"{op}: weight must be [out_features, {in_features}] for x of shape {tuple(x.shape)}; "
                         f"got {tuple(weight.shape)}")
    out_features = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(f"{op}: bias must be [{out_features}], got {tuple(bias.shape)}")
    if lora_A.dim() != 2 or lora_A.shape[1] != in_features or lora_A.shape[0] < 1:
        raise ValueError(f"{op}: lora_A must be [r, {in_features}] with r >= 1 (PEFT's lora_A.weight); "
                         f"got {tuple(lora_A.shape)}")
    rank = lora_A.shape[0]
    if lora_B.dim() != 2 or tuple(lora_B.shape) != (out_features, rank):
        raise ValueError(f"{op}: lora_B must be [{out_features}, {rank}] (PEFT's lora_B.weight) for weight "
                         f"{tuple(weight.shape)} and lora_A {tuple(lora_A.shape)}; got {tuple(lora_B.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.requires_grad:
            raise ValueError(f"{op}: the base {name} requires grad, but the base layer is frozen in LoRA (PEFT "
                             f"freezes it); call {name}.requires_grad_(False), or train it without LoRA")
    if lora_A.dtype != lora_B.dtype:
        raise ValueError(f"{op}: lora_A and lora_B must share one dtype (PEFT creates them so); got "
                         f"{lora_A.dtype} and {lora_B.dtype}")
    scaling = _check_number(op, "scaling", scaling, -math.inf)
    dropout_p = _check_number(op, "dropout_p", dropout_p, 0.0, 1.0, high_open=True)
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        if lora_A.dtype not in (torch.float32, dtype):
            raise ValueError(f"{op}: under {dtype} autocast the adapters must be float32 or {dtype}; got "
                             f"{lora_A.dtype} (PEFT would round x to it before autocast's cast)")
        if quantized and weight.dtype != dtype:
            raise ValueError(f"{op}: the quantized base computes in {weight.dtype} but autocast runs {dtype}; "
                             "set the quantized layer's compute dtype to the autocast dtype")
        lora_A, lora_B = lora_A.to(dtype), lora_B.to(dtype)
        bias = None if bias is None else bias.to(dtype)
        if quantized:  # no autocast op: x is cast inside, the result is in x's dtype (_split_output)
            result_dtype = x.dtype
        else:
            x, weight = x.to(dtype), weight.to(dtype)
    else:
        for name, t in (("weight", weight), ("bias", bias)):
            if t is not None and t.dtype != x.dtype:
                what = "compute dtype of the quantized base" if quantized and name == "weight" else f"base {name}"
                raise ValueError(f"{op}: x is {x.dtype} but the {what} is {t.dtype}; outside autocast "
                                 "the base GEMM needs one dtype (cast x, or run under torch.autocast)")
    return x, weight, bias, lora_A, lora_B, scaling, dropout_p, result_dtype


def lora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_A: torch.Tensor,
                lora_B: torch.Tensor, scaling: float, dropout_p: float = 0.0, seed=None) -> torch.Tensor:
    """``F.linear(x, weight, bias) + scaling * lora_B(lora_A(dropout(x)))`` as PEFT's ``lora.Linear``.

    x [..., in], weight [out, in] and bias [out] (frozen: they must not require grad), lora_A [r, in],
    lora_B [out, r] (PEFT's ``lora_A.weight``, ``lora_B.weight``), scaling ``lora_alpha / r`` (or
    ``lora_alpha / sqrt(r)`` for rsLoRA). ``dropout_p`` is applied as given (pass 0 in eval mode);
    ``seed`` (int, one-element int64 tensor, or None to draw :func:`lora_dropout_seed`) fixes the mask,
    which :func:`lora_dropout_mask` returns (under torch.compile pass a tensor or None: a Python int is a
    constant of the graph). Returns [..., out] in the base result's dtype.
    """
    op = "lora_linear"
    x_c, weight, bias, lora_A, lora_B, scaling, dropout_p, result_dtype = _prepare_projection(
        op, x, weight, bias, lora_A, lora_B, scaling, dropout_p)
    seed_t = _seed_tensor(op, seed, x.device) if dropout_p > 0 else None
    if not use_triton(x.device):
        return lora_linear_reference(x_c, weight, bias, lora_A, lora_B, scaling, dropout_p, seed_t, result_dtype)
    x2d = rows_view(x_c, x_c.shape[-1])
    with torch.autocast(x.device.type, enabled=False):
        out = _LoRALinearFunction.apply(x2d, weight, bias, lora_A, lora_B, scaling, dropout_p, seed_t, result_dtype)
    return out.view(*x.shape[:-1], weight.shape[0])


def lora_linears(x: torch.Tensor, projections: Sequence[Sequence]) -> tuple[torch.Tensor, ...]:
    """:func:`lora_linear` of one input for several projections (an attention block's q, k, v).

    ``projections``: a sequence of ``(weight, bias, lora_A, lora_B, scaling, dropout_p, seed)``. x is
    passed to one autograd op and saved once, with one input gradient; each projection with dropout has
    its own mask (its own seed: None draws one per projection, in order). Without dropout (and one adapter
    dtype) the down-projections are one GEMM on the stacked A's, forward and backward; the base GEMMs stay
    one per projection. Returns one output per projection.
    """
    op = "lora_linears"
    if not isinstance(projections, (list, tuple)) or len(projections) == 0:
        raise ValueError(f"{op}: projections must be a non-empty list of (weight, bias, lora_A, lora_B, "
                         "scaling, dropout_p, seed) tuples")
    prepared, result_dtypes = [], []
    x_c = None
    for i, proj in enumerate(projections):
        if not isinstance(proj, (list, tuple)) or len(proj) != 7:
            got = f"{type(proj).__name__} of length {len(proj)}" if isinstance(proj, (list, tuple)) else repr(proj)
            raise ValueError(f"{op}: projection {i} must be (weight, bias, lora_A, lora_B, scaling, dropout_p, "
                             f"seed); got {got}")
        weight, bias, lora_A, lora_B, scaling, dropout_p, seed = proj
        x_i, weight, bias, lora_A, lora_B, scaling, dropout_p, result_dtype = _prepare_projection(
            f"{op}[{i}]", x, weight, bias, lora_A, lora_B, scaling, dropout_p)
        x_c = x_i if x_c is None else x_c  # the same cast of x for every projection
        seed_t = _seed_tensor(op, seed, x.device) if dropout_p > 0 else None
        prepared.append((weight, bias, lora_A, lora_B, scaling, dropout_p, seed_t))
        result_dtypes.append(result_dtype)
    if len(set(result_dtypes)) > 1:  # quantized and dense bases under autocast: x reaches each kind as its own
        outs = [None] * len(prepared)
        for kind in set(result_dtypes):
            chosen = [i for i, rd in enumerate(result_dtypes) if rd == kind]
            for i, out in zip(chosen, lora_linears(x, [prepared[i] for i in chosen])):
                outs[i] = out
        return tuple(outs)
    result_dtype = result_dtypes[0]
    if not use_triton(x.device):
        return lora_linears_reference(x_c, prepared, result_dtype)
    has_bias = tuple(p[1] is not None for p in prepared)
    scalings = tuple(p[4] for p in prepared)
    dropout_ps = tuple(p[5] for p in prepared)
    stacked = all(p == 0 for p in dropout_ps) and len({p[2].dtype for p in prepared}) == 1 and len(prepared) > 1
    tensors = []
    for weight, bias, lora_A, lora_B, _, _, seed_t in prepared:
        tensors += [weight] + ([bias] if bias is not None else []) + [lora_A, lora_B]
        tensors += [seed_t] if seed_t is not None else []
    x2d = rows_view(x_c, x_c.shape[-1])
    with torch.autocast(x.device.type, enabled=False):
        outs = _LoRALinearsFunction.apply(
            x2d, (has_bias, scalings, dropout_ps, stacked, tuple(x.shape[:-1]), result_dtype), *tensors)
    return tuple(outs)


def lora_dropout_mask(seed, shape: Sequence[int], p: float, device: torch.device | str | None = None
                      ) -> torch.Tensor:
    """The keep mask (bool, ``shape``) that :func:`lora_linear` applies with ``seed`` and ``dropout_p=p``
    to an input of ``shape`` ([..., in]); made by the kernel when Triton serves ``device``, else by the
    torch reference (the two are bit-identical)."""
    op = "lora_dropout_mask"
    device = torch.device(device) if device is not None else (seed.device if isinstance(seed, torch.Tensor)
                                                              else torch.device("cpu"))
    p = _check_number(op, "p", p, 0.0, 1.0, high_open=True)
    shape = tuple(int(s) for s in shape)
    if len(shape) < 1:
        raise ValueError(f"{op}: shape must be [..., in_features], got {shape}")
    seed_t = _seed_tensor(op, seed, device)
    n_cols = shape[-1]
    n_rows = math.prod(shape[:-1])
    if p == 0:
        return torch.ones(shape, dtype=torch.bool, device=device)
    if not use_triton(device):
        return lora_dropout_mask_reference(seed_t, n_rows, n_cols, p).view(shape)
    ones = torch.ones(n_rows, n_cols, device=device)
    return (_dropout_op(ones, seed_t, p, torch.float32) != 0).view(shape)
