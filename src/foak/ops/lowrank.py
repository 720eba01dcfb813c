"""Rank-sized products in fp32 over 16-bit tensors, without an fp32 copy of the big operand.

A LoRA adapter kept in fp32 on a bf16 (or fp16) base outside autocast (PEFT's default adapter dtype, a
custom training loop) computes every adapter product in fp32: PEFT casts the layer input to fp32, adds
the fp32 adapter output to the base output and casts the sum back. Done with torch's ops that moves an
fp32 copy of every [tokens, features] operand (a cast writes 4 bytes and the GEMM reads them again, per
element, for the output and for each of the backward's products). The three products here read the big
operand in its own dtype, convert it in registers (exact: every bf16/fp16 value is an fp32 value) and
accumulate in fp32 (IEEE, no TF32), so the values are those of the fp32 math:

- :func:`lowrank_down`: ``scale * x @ a^T`` in fp32, ``x`` [M, K] 16- or 32-bit, ``a`` [R, K] fp32: the
  adapter's down projection ``x A^T`` and, with ``a = B^T``, the gradient ``dy B``.
- :func:`lowrank_add_`: ``out <- out + scale * h @ b^T`` summed in fp32 and rounded once to out's dtype
  (``accumulate=False``: ``out <- scale * h @ b^T``), ``h`` [M, R] and ``b`` [N, R] fp32: the adapter's
  up projection added to the base output, and ``(dy B) A`` added to the input gradient.
- :func:`lowrank_tokens`: ``scale * x^T @ g`` in fp32, a reduction over the M rows (tokens), ``x`` [M, N]
  16- or 32-bit, ``g`` [M, R] fp32: the adapter weights' gradients ``dy^T h`` and ``x^T (dy B)``. Rows are
  split across programs and the fp32 partial sums added in a fixed order (deterministic).

The products are exact fp32 math either way. With a bf16 operand (``TUNING["split"]``) they run on the tensor
cores: the fp32 operand is split into three bf16 parts whose sum is it to within fp32 rounding (each part the
bf16 rounding of what the previous parts leave), and each bf16 x bf16 product is exact in the fp32 accumulator;
:func:`lowrank_add_`'s two fp32 operands are both split (the six products above fp32's precision). Otherwise
(fp16 operands) IEEE fp32 FMA dots.

``keep=(seed, p)``: the big operand (x for the down projection and the token reductions, the product for
:func:`lowrank_add_`) is dropped out first, as LoRA dropout drops out the adapter's input: its elements multiplied
by foak's LoRA dropout mask of ``(seed, p)`` for its shape (:func:`foak.ops.lora.lora_dropout_mask`, generated
here tile by tile) and by ``1 / (1 - p)``.

R is a LoRA rank, or the sum of a few stacked ones (any size: blocks of up to 64 ranks, padded to a power of two
>= 16). Any strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foak.ops._custom_op import custom_op
from foak.ops._philox_mask import drop_threshold, keep_mask_tile

# "ranks": the largest rank block; "split": the bf16 tensor-core products below (else fp32 FMA dots)
TUNING = {"rows": 64, "cols": 64, "ranks": 64, "warps": 4, "programs": 1024, "split": True}
SIXTEEN_BIT = (torch.bfloat16, torch.float16)
# Device types on which foak.ops.lora takes these kernels for fp32 adapters on 16-bit activations (else torch's
# fp32-copy path). CUDA: checked by benchmarks/lowrank.py on an H100 (benchmarks/results/h100_2026-12-07b/).
USE = {"cpu": True, "cuda": True}


# 1. reference -------------------------------------------------------------------------------------
def _dropped(t: torch.Tensor, keep) -> torch.Tensor:
    """t (fp32) times foak's LoRA dropout mask of ``keep=(seed, p)`` and 1 / (1 - p); t itself for None."""
    if keep is None:
        return t
    from foak.ops.lora import lora_dropout_mask_reference  # (foak.ops.lora imports this module)

    seed, p = keep
    mask = lora_dropout_mask_reference(seed.reshape(1), t.shape[0], t.shape[1], p)
    return torch.where(mask, t * (1.0 / (1.0 - p)), torch.zeros((), dtype=t.dtype, device=t.device))


def lowrank_down_reference(x: torch.Tensor, a: torch.Tensor, scale: float = 1.0, keep=None) -> torch.Tensor:
    return torch.mm(_dropped(x.float(), keep), a.float().t()) * scale


def lowrank_add_reference(out: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scale: float = 1.0,
                          accumulate: bool = True, keep=None) -> torch.Tensor:
    product = _dropped(torch.mm(h.float(), b.float().t()) * scale, keep)
    return out.copy_(out.float() + product if accumulate else product)


def lowrank_tokens_reference(x: torch.Tensor, g: torch.Tensor, scale: float = 1.0, keep=None) -> torch.Tensor:
    return torch.mm(_dropped(x.float(), keep).t(), g.float()) * scale


# 2. kernels ---------------------------------------------------------------------------------------
@triton.jit
def _split3(a):
    """Three bf16 tensors summing to the fp32 ``a`` to within fp32 rounding (each subtraction is exact)."""
    a1 = a.to(tl.bfloat16)
    rest = a - a1.to(tl.float32)
    a2 = rest.to(tl.bfloat16)
    return a1, a2, (rest - a2.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _dot(x, a, acc, SPLIT: tl.constexpr):
    """acc + x @ a in fp32; SPLIT: x holds bf16 values, a is split into three bf16 parts (tensor cores). The
    tensor cores sum one tile's products from zero and the tile's sum is added to acc in registers: their own
    accumulation drops bits (H100: kept there over K = 4096 it was 1.4e-5 from fp64, 12x the FMA dots' error)."""
    if SPLIT:
        xb = x.to(tl.bfloat16)
        a1, a2, a3 = _split3(a.to(tl.float32))
        part = tl.dot(xb, a3)
        part = tl.dot(xb, a2, part)
        part = tl.dot(xb, a1, part)
        acc += part
    else:
        acc = tl.dot(x.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
    return acc


@triton.jit
def _dot_fp32(h, b, acc, SPLIT: tl.constexpr):
    """acc + h @ b for fp32 h and b; SPLIT: both split into three bf16 parts, the six products that matter."""
    if SPLIT:
        h1, h2, h3 = _split3(h)
        b1, b2, b3 = _split3(b)
        part = tl.dot(h1, b3)
        part = tl.dot(h3, b1, part)
        part = tl.dot(h2, b2, part)
        part = tl.dot(h1, b2, part)
        part = tl.dot(h2, b1, part)
        part = tl.dot(h1, b1, part)
        acc += part  # as in _dot
    else:
        acc = tl.dot(h, b, acc, input_precision="ieee")
    return acc


@triton.jit
def _down_kernel(X, sxm, sxk, A, sar, sak, H, shm, shr, M, K, R, scale, SEED, threshold, DROPOUT: tl.constexpr,
                 SPLIT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    ranks = tl.program_id(1) * BR + tl.arange(0, BR)
    acc = tl.zeros((BM, BR), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        x = tl.load(X + rows[:, None] * sxm + ks[None, :] * sxk, mask=(rows[:, None] < M) & (ks[None, :] < K),
                    other=0.0)
        if DROPOUT:
            x = tl.where(keep_mask_tile(tl.load(SEED), rows, k0, tl.cdiv(K, 4), threshold, BM, BK), x, 0.0)
        a = tl.load(A + ranks[None, :] * sar + ks[:, None] * sak, mask=(ranks[None, :] < R) & (ks[:, None] < K),
                    other=0.0)
        acc = _dot(x, a, acc, SPLIT)
    tl.store(H + rows[:, None] * shm + ranks[None, :] * shr, acc * scale,
             mask=(rows[:, None] < M) & (ranks[None, :] < R))


@triton.jit
def _add_kernel(OUT, som, son, Hh, shm, shr, B, sbn, sbr, M, N, R, scale, SEED, threshold, DROPOUT: tl.constexpr,
                ACCUMULATE: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BR: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
    cols = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
    product = tl.zeros((BM, BN), dtype=tl.float32)
    for r0 in range(0, R, BR):
        ranks = r0 + tl.arange(0, BR)
        h = tl.load(Hh + rows[:, None] * shm + ranks[None, :] * shr,
                    mask=(rows[:, None] < M) & (ranks[None, :] < R), other=0.0).to(tl.float32)
        bt = tl.load(B + cols[None, :] * sbn + ranks[:, None] * sbr,
                     mask=(cols[None, :] < N) & (ranks[:, None] < R), other=0.0).to(tl.float32)
        product = _dot_fp32(h, bt, product, SPLIT)
    product *= scale
    if DROPOUT:
        col0 = tl.program_id(1) * BN
        product = tl.where(keep_mask_tile(tl.load(SEED), rows, col0, tl.cdiv(N, 4), threshold, BM, BN), product, 0.0)
    in_tile = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None] * som + cols[None, :] * son
    if ACCUMULATE:
        product += tl.load(OUT + offs, mask=in_tile, other=0.0).to(tl.float32)
    tl.store(OUT + offs, product.to(OUT.dtype.element_ty), mask=in_tile)


@triton.jit
def _tokens_kernel(X, sxm, sxn, G, sgm, sgr, P, M, N, R, rows_per_split, rank_blocks, SEED, threshold,
                   DROPOUT: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    # P[split, n, r] = sum over this split's rows m of X[m, n] * G[m, r]
    col0 = (tl.program_id(0) // rank_blocks) * BN
    cols = col0.to(tl.int64) + tl.arange(0, BN)
    ranks = (tl.program_id(0) % rank_blocks) * BR + tl.arange(0, BR)
    split = tl.program_id(1).to(tl.int64)
    first = split * rows_per_split
    end = tl.minimum(first + rows_per_split, M)
    acc = tl.zeros((BN, BR), dtype=tl.float32)
    for m0 in range(first, end, BM):
        rows = m0 + tl.arange(0, BM)
        x = tl.load(X + rows[:, None] * sxm + cols[None, :] * sxn, mask=(rows[:, None] < end) & (cols[None, :] < N),
                    other=0.0)
        if DROPOUT:
            x = tl.where(keep_mask_tile(tl.load(SEED), rows, col0, tl.cdiv(N, 4), threshold, BM, BN), x, 0.0)
        g = tl.load(G + rows[:, None] * sgm + ranks[None, :] * sgr, mask=(rows[:, None] < end) & (ranks[None, :] < R),
                    other=0.0)
        acc = _dot(tl.trans(x), g, acc, SPLIT)
    tl.store(P + split * N * R + cols[:, None] * R + ranks[None, :], acc,
             mask=(cols[:, None] < N) & (ranks[None, :] < R))


# 3. launchers -------------------------------------------------------------------------------------
def _split(x: torch.Tensor) -> bool:
    return bool(TUNING["split"]) and x.dtype == torch.bfloat16


def _rank_block(r: int) -> int:
    return max(16, min(TUNING["ranks"], triton.next_power_of_2(r)))


def _keep_args(keep, scale, unused):
    """(scale with 1 / (1 - p) folded in, seed tensor, threshold, DROPOUT) for the kernels; without dropout the
    seed pointer is ``unused`` (any tensor of the call: the kernels do not read it then, so nothing is allocated)."""
    if keep is None:
        return scale, unused, 0, False
    seed, p = keep
    return scale / (1.0 - p), seed, drop_threshold(p), True


def _down_launch(x, a, scale, h, keep=None):
    (m, k), r = x.shape, a.shape[0]
    if m == 0:
        return
    bm, bk, br = TUNING["rows"], TUNING["cols"], _rank_block(r)
    scale, seed, threshold, dropout = _keep_args(keep, scale, h)
    _down_kernel[(triton.cdiv(m, bm), triton.cdiv(r, br))](
        x, x.stride(0), x.stride(1), a, a.stride(0), a.stride(1), h, h.stride(0), h.stride(1), m, k, r, scale,
        seed, threshold, DROPOUT=dropout, SPLIT=_split(x), BM=bm, BK=bk, BR=br, num_warps=TUNING["warps"])


def _add_launch(out, h, b, scale, accumulate, keep=None):
    (m, n), r = out.shape, h.shape[1]
    if out.numel() == 0:
        return
    bm, bn = TUNING["rows"], TUNING["cols"]
    scale, seed, threshold, dropout = _keep_args(keep, scale, out)
    _add_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        out, out.stride(0), out.stride(1), h, h.stride(0), h.stride(1), b, b.stride(0), b.stride(1), m, n, r, scale,
        seed, threshold, DROPOUT=dropout, ACCUMULATE=accumulate, SPLIT=bool(TUNING["split"]), BM=bm, BN=bn,
        BR=_rank_block(r), num_warps=TUNING["warps"])


def _tokens_launch(x, g, scale, keep=None):
    (m, n), r = x.shape, g.shape[1]
    bm, bn, br = TUNING["rows"], TUNING["cols"], _rank_block(r)
    col_blocks = triton.cdiv(n, bn) * triton.cdiv(r, br)
    # enough programs to fill the GPU; each split a whole number of row blocks
    splits = max(1, min(triton.cdiv(m, bm), TUNING["programs"] // col_blocks))
    rows_per_split = max(1, triton.cdiv(triton.cdiv(m, splits), bm)) * bm
    splits = max(1, triton.cdiv(m, rows_per_split))
    partial = torch.empty((splits, n, r), dtype=torch.float32, device=x.device)
    scale, seed, threshold, dropout = _keep_args(keep, scale, partial)
    if m and n:
        _tokens_kernel[(col_blocks, splits)](x, x.stride(0), x.stride(1), g, g.stride(0), g.stride(1), partial, m,
                                             n, r, rows_per_split, triton.cdiv(r, br), seed, threshold,
                                             DROPOUT=dropout, SPLIT=_split(x), BM=bm, BN=bn, BR=br,
                                             num_warps=TUNING["warps"])
    else:
        partial.zero_()
    out = partial[0] if splits == 1 else partial.sum(0)
    return out if scale == 1.0 else out.mul_(scale)


# 4. custom ops ------------------------------------------------------------------------------------
# (seed, p): no dropout when seed is None
def _keep(seed, p):
    return None if seed is None else (seed, p)


def _down_fake(x, a, scale, seed, p):
    return x.new_empty((x.shape[0], a.shape[0]), dtype=torch.float32)


@custom_op("lowrank_down", _down_fake)
def _down_op(x: torch.Tensor, a: torch.Tensor, scale: float, seed: torch.Tensor | None, p: float) -> torch.Tensor:
    h = torch.empty((x.shape[0], a.shape[0]), dtype=torch.float32, device=x.device)
    _down_launch(x, a, scale, h, _keep(seed, p))
    return h


def _add_fake(out, h, b, scale, accumulate, seed, p):
    return None


@custom_op("lowrank_add", _add_fake, mutates_args=("out",))
def _add_op(out: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scale: float, accumulate: bool,
            seed: torch.Tensor | None, p: float) -> None:
    _add_launch(out, h, b, scale, accumulate, _keep(seed, p))


def _tokens_fake(x, g, scale, seed, p):
    return x.new_empty((x.shape[1], g.shape[1]), dtype=torch.float32)


@custom_op("lowrank_tokens", _tokens_fake)
def _tokens_op(x: torch.Tensor, g: torch.Tensor, scale: float, seed: torch.Tensor | None, p: float) -> torch.Tensor:
    return _tokens_launch(x, g, scale, _keep(seed, p))


# 5. public functions (no autograd: called inside the LoRA ops' forward and backward) -----------------
def _check(op: str, **tensors) -> None:
    for name, t in tensors.items():
        if t.dim() != 2:
            raise ValueError(f"{op}: {name} must be 2-D, got shape {tuple(t.shape)}")
        if t.dtype not in (torch.float32, *SIXTEEN_BIT):
            raise ValueError(f"{op}: {name} has dtype {t.dtype}; expected float32, bfloat16 or float16")
    if len({t.device for t in tensors.values()}) > 1:
        raise ValueError(f"{op}: all tensors must be on one device; got "
                         + ", ".join(f"{n} on {t.device}" for n, t in tensors.items()))


def _check_keep(op: str, keep, device):
    """(seed tensor or None, p) of ``keep=(seed, p)``."""
    if keep is None:
        return None, 0.0
    seed, p = keep
    if not (isinstance(seed, torch.Tensor) and seed.dtype == torch.int64 and seed.numel() == 1
            and seed.device == device):
        raise ValueError(f"{op}: keep's seed must be a one-element int64 tensor on {device} "
                         f"(foak.ops.lora.lora_dropout_seed draws one)")
    if not 0.0 < float(p) < 1.0:
        raise ValueError(f"{op}: keep's dropout probability must be in (0, 1), got {p!r}")
    return seed.reshape(1), float(p)


def lowrank_down(x: torch.Tensor, a: torch.Tensor, scale: float = 1.0, keep=None) -> torch.Tensor:
    """``scale * dropout(x) @ a^T`` in fp32 ([M, R]); x [M, K] is read in its own dtype. ``keep=(seed, p)``:
    x dropped out with foak's LoRA dropout mask of that seed (else not)."""
    _check("lowrank_down", x=x, a=a)
    if a.shape[1] != x.shape[1]:
        raise ValueError(f"lowrank_down: a must be [R, {x.shape[1]}] for x of shape {tuple(x.shape)}, "
                         f"got {tuple(a.shape)}")
    return _down_op(x, a, float(scale), *_check_keep("lowrank_down", keep, x.device))


def lowrank_add_(out: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scale: float = 1.0,
                 accumulate: bool = True, keep=None) -> torch.Tensor:
    """``out <- out + scale * dropout(h @ b^T)`` (``accumulate=False``: ``out <- scale * dropout(h @ b^T)``),
    summed in fp32 and rounded once to out's dtype. out [M, N], h [M, R], b [N, R]; ``keep=(seed, p)``: the
    product dropped out with foak's LoRA dropout mask of that seed for out's shape. Returns out."""
    _check("lowrank_add_", out=out, h=h, b=b)
    if h.shape[0] != out.shape[0] or b.shape != (out.shape[1], h.shape[1]):
        raise ValueError(f"lowrank_add_: expected h [{out.shape[0]}, R] and b [{out.shape[1]}, R] for out of shape "
                         f"{tuple(out.shape)}, got h {tuple(h.shape)} and b {tuple(b.shape)}")
    _add_op(out, h, b, float(scale), bool(accumulate), *_check_keep("lowrank_add_", keep, out.device))
    return out


def lowrank_tokens(x: torch.Tensor, g: torch.Tensor, scale: float = 1.0, keep=None) -> torch.Tensor:
    """``scale * dropout(x)^T @ g`` in fp32 ([N, R]), summed over the M rows; x [M, N] is read in its own dtype.
    ``keep=(seed, p)``: x dropped out with foak's LoRA dropout mask of that seed (else not)."""
    _check("lowrank_tokens", x=x, g=g)
    if g.shape[0] != x.shape[0]:
        raise ValueError(f"lowrank_tokens: g must have x's {x.shape[0]} rows, got shape {tuple(g.shape)}")
    return _tokens_op(x, g, float(scale), *_check_keep("lowrank_tokens", keep, x.device))
