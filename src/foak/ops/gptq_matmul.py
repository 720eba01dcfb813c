"""``y = x W^T + b`` with a GPTQ 4-bit ``W`` dequantized inside the GEMM's inner loop (one Triton kernel).

For few rows (decoding, small batches) a linear layer is bound by reading its weight: dequantizing the
whole weight to a dense bf16 copy first (:meth:`foak.ops.gptq.GPTQWeight.dequantize`, then cuBLAS) reads
0.5 bytes per weight, writes 2 and reads those 2 again, where this kernel reads the 0.5 bytes only. For
many rows (training: thousands of tokens) the GEMM is compute bound and cuBLAS on a dense copy is the
faster choice; :func:`gptq_linear` picks by the number of rows (``TUNING["max_rows"]``, measured on the
H200: benchmarks/gptq.py).

The weight each program uses is bit-identical to :func:`foak.ops.gptq.gptq_dequantize`'s (the same fp32
product rounded once to the compute dtype); the products are summed in fp32 by ``tl.dot`` (fp32 inputs in
IEEE precision, never TF32), in an order that differs from cuBLAS's. ``split_k`` > 1 cuts the reduction
into that many slices summed in fp32 afterwards, so that a few rows still fill the GPU.

The backward (``dx = dy W``) dequantizes and calls cuBLAS: the op serves inference and the rare few-row
training step; ``b`` gets its gradient when it requires one, ``W`` is frozen.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foak.backend import use_triton
from foak.ops._custom_op import custom_op
from foak.ops.gptq import PACK, GPTQWeight

# block_m >= 16 (tl.dot); block_k a multiple of 8 (whole int32 words; >= 128 with by_nibble: each of its eight
# dots spans block_k / 8 >= 16); by_nibble: eight dots per K tile, one per nibble position, instead of one dot
# on the interleaved unpacked tile; max_rows / act_order_max_rows: gptq_linear runs this kernel for at most
# that many rows (plain groups / act-order) and dequantize + cuBLAS above.
TUNING = {"block_m": 16, "block_n": 128, "block_k": 64, "split_k": 8, "warps": 4, "stages": 3, "by_nibble": False,
          "max_rows": 64, "act_order_max_rows": 0, "wide_from_rows": 17,
          "wide": {"block_k": 128, "split_k": 2}}  # "wide": overrides from that many rows on
# (the fastest tiles of the H200 sweep for 1-16 and 17-64 rows: benchmarks/results/gptq_matmul_h200.json)


# 1. reference -------------------------------------------------------------------------------------
def gptq_matmul_reference(x: torch.Tensor, weight: GPTQWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight.dequantize(x.dtype), bias)``: the dense computation this op replaces."""
    return torch.nn.functional.linear(x, weight.dequantize(x.dtype), bias)


# 2. kernel ----------------------------------------------------------------------------------------
@triton.jit
def _gptq_matmul_kernel(
    X, QWEIGHT, QZEROS, SCALES, G_IDX, OUT,
    M, N, K, stride_xm, zero_cols, group_size, k_per_split,
    ZERO_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUPED: tl.constexpr, IEEE: tl.constexpr, BY_NIBBLE: tl.constexpr,
):
    # program (m, n, s): OUT[s, m-block, n-block] = sum over the s-th K slice of x[m, k] * W[n, k]
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    EIGHTHS: tl.constexpr = BLOCK_K // 8
    shifts = tl.arange(0, 8) * 4
    if GROUPED:
        zshift = (n % 8) * 4
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        words = k0 // 8 + tl.arange(0, EIGHTHS)
        words_ok = words < k_hi // 8
        packed = tl.load(QWEIGHT + words.to(tl.int64)[:, None] * N + n[None, :],
                         mask=words_ok[:, None] & n_ok[None, :], other=0)  # [BLOCK_K / 8, BLOCK_N]
        if GROUPED:
            # the K tile lies in one group: one scale and zero per output column
            group = k0 // group_size
            scale = tl.load(SCALES + group * N + n, mask=n_ok, other=0.0).to(tl.float32)
            zword = tl.load(QZEROS + group * zero_cols + n // 8, mask=n_ok, other=0)
            zero = ((zword >> zshift) & 15) + ZERO_OFFSET
        if BY_NIBBLE:
            # eight dots per tile, one per nibble position s: rows k = 8 * word + s of W^T against the
            # matching (strided) columns of x; no interleaving of the unpacked nibbles
            for s in tl.static_range(8):
                k = words * 8 + s
                x = tl.load(X + m.to(tl.int64)[:, None] * stride_xm + k[None, :],
                            mask=m_ok[:, None] & words_ok[None, :], other=0.0)
                q = (packed >> (4 * s)) & 15
                if GROUPED:
                    w = scale[None, :] * (q - zero[None, :]).to(tl.float32)
                else:
                    g = tl.load(G_IDX + k, mask=words_ok, other=0)
                    tile_ok = words_ok[:, None] & n_ok[None, :]
                    scale_k = tl.load(SCALES + g[:, None] * N + n[None, :], mask=tile_ok, other=0.0).to(tl.float32)
                    zword_k = tl.load(QZEROS + g[:, None] * zero_cols + (n // 8)[None, :], mask=tile_ok, other=0)
                    zero_k = ((zword_k >> ((n % 8) * 4)[None, :]) & 15) + ZERO_OFFSET
                    w = scale_k * (q - zero_k).to(tl.float32)
                if IEEE:
                    acc = tl.dot(x, w.to(x.dtype), acc, input_precision="ieee")
                else:
                    acc = tl.dot(x, w.to(x.dtype), acc)
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < k_hi
            x = tl.load(X + m.to(tl.int64)[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0)
            q = tl.reshape((packed[:, None, :] >> shifts[None, :, None]) & 15, (BLOCK_K, BLOCK_N))  # [k, n]
            if GROUPED:
                w = scale[None, :] * (q - zero[None, :]).to(tl.float32)
            else:
                g = tl.load(G_IDX + k, mask=k_ok, other=0)
                tile_ok = k_ok[:, None] & n_ok[None, :]
                scale = tl.load(SCALES + g[:, None] * N + n[None, :], mask=tile_ok, other=0.0).to(tl.float32)
                zword = tl.load(QZEROS + g[:, None] * zero_cols + (n // 8)[None, :], mask=tile_ok, other=0)
                zero = ((zword >> ((n % 8) * 4)[None, :]) & 15) + ZERO_OFFSET
                w = scale * (q - zero).to(tl.float32)
            if IEEE:
                acc = tl.dot(x, w.to(x.dtype), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w.to(x.dtype), acc)
    out = OUT + pid_s.to(tl.int64) * M * N + m.to(tl.int64)[:, None] * N + n[None, :]
    tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])


# 3. launcher and custom op ------------------------------------------------------------------------
def _launch(x2, qweight, qzeros, scales, g_idx, zero_offset, group_size):
    """x2 [M, K] (unit stride along K) -> fp32 partial sums [split, M, N]."""
    M, K = x2.shape
    N = qweight.shape[1]
    tuning = {**TUNING, **TUNING["wide"]} if M >= TUNING["wide_from_rows"] else TUNING
    block_m, block_n, block_k = tuning["block_m"], tuning["block_n"], tuning["block_k"]
    grouped = group_size > 0 and (group_size >= K or group_size % block_k == 0)
    split = max(1, min(tuning["split_k"], triton.cdiv(K, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(K, split), block_k) * block_k  # whole K tiles per slice
    split = triton.cdiv(K, k_per_split)
    out = torch.empty((split, M, N), dtype=torch.float32, device=x2.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), split)
    _gptq_matmul_kernel[grid](
        x2, qweight, qzeros, scales, g_idx, out,
        M, N, K, x2.stride(0), N // PACK, group_size if grouped else 1, k_per_split,
        ZERO_OFFSET=zero_offset, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUPED=grouped,
        IEEE=x2.dtype == torch.float32, BY_NIBBLE=tuning["by_nibble"], num_warps=tuning["warps"], num_stages=tuning["stages"],
    )
    return out


def _matmul_fake(x2, qweight, qzeros, scales, g_idx, bias, zero_offset, group_size):
    return x2.new_empty((x2.shape[0], qweight.shape[1]))


@custom_op("gptq_matmul", _matmul_fake)
def _matmul_op(x2: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor, bias: torch.Tensor | None, zero_offset: int, group_size: int) -> torch.Tensor:
    partial = _launch(x2, qweight, qzeros, scales, g_idx, zero_offset, group_size)
    out = partial[0] if partial.shape[0] == 1 else partial.sum(0)
    if bias is not None:  # in fp32, before the one rounding to x's dtype
        out = out + bias.float()
    return out.to(x2.dtype)


def _fused(x2: torch.Tensor, weight: GPTQWeight, bias) -> torch.Tensor:
    return _matmul_op(x2, weight.qweight, weight.qzeros, weight.scales, weight.g_idx, bias, weight.zero_offset,
                      weight._group_size)


# 4. autograd --------------------------------------------------------------------------------------
class _GPTQLinearFunction(torch.autograd.Function):
    """Forward by the fused kernel (``fused``) or by cuBLAS on a dense copy dropped right after; the backward
    dequantizes again for ``dx``: no dense weight is kept from the forward to the backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, fused):
        ctx.weight = weight
        ctx.bias_grad = bias is not None and ctx.needs_input_grad[2]
        if not fused:
            return torch.nn.functional.linear(x, weight.dequantize(x.dtype), bias)
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = _fused(x2, weight, bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        dx = dbias = None
        if ctx.needs_input_grad[0]:
            dx = dy.matmul(ctx.weight.dequantize(dy.dtype))
        if ctx.bias_grad:
            dbias = dy.reshape(-1, dy.shape[-1]).sum(0)
        return dx, None, dbias, None


# 5. public functions ------------------------------------------------------------------------------
def _check(op, x, weight, bias):
    if not isinstance(weight, GPTQWeight):
        raise ValueError(f"{op}: weight must be a foak.ops.gptq.GPTQWeight, got {type(weight).__name__}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise ValueError(f"{op}: x must be a floating-point tensor [..., in_features], got "
                         + (f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__))
    out_features, in_features = weight.shape
    if x.shape[-1] != in_features:
        raise ValueError(f"{op}: x has {x.shape[-1]} features in its last dimension; the weight "
                         f"{tuple(weight.shape)} takes in_features={in_features}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{op}: x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.device != weight.device:
        raise ValueError(f"{op}: x is on {x.device} but the weight on {weight.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (out_features,) or bias.dtype != x.dtype \
                or bias.device != x.device:
            raise ValueError(f"{op}: bias must be a [{out_features}] tensor of x's dtype {x.dtype} on {x.device}, "
                             "got " + (f"{bias.dtype} {tuple(bias.shape)} on {bias.device}"
                                       if isinstance(bias, torch.Tensor) else type(bias).__name__))


def gptq_matmul(x: torch.Tensor, weight: GPTQWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for a GPTQ :class:`~foak.ops.gptq.GPTQWeight` ``W`` with the dequantization inside the
    GEMM (any number of rows; see :func:`gptq_linear` for the choice by row count). ``x`` ``[..., in]``
    (fp32, bf16 or fp16): the GEMM runs in x's dtype on the weight dequantized to it (bit-identical to
    ``weight.dequantize(x.dtype)``), which may differ from the weight's default compute dtype; ``bias``
    ``[out]`` of x's dtype or None. Differentiable in ``x`` and ``bias``.
    Without Triton for ``x``'s device (CPU outside the interpreter) it runs the dense path of gptq_linear."""
    _check("gptq_matmul", x, weight, bias)
    return _GPTQLinearFunction.apply(x, weight, bias, use_triton(x.device))


def gptq_linear(x: torch.Tensor, weight: GPTQWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` by the faster way for ``x``'s number of rows: :func:`gptq_matmul` (dequantization in the
    GEMM) for at most ``TUNING["max_rows"]`` rows (``TUNING["act_order_max_rows"]`` under act-order), else ``F.linear`` on a dense copy from
    ``weight.dequantize()`` (cuBLAS), dropped after the GEMM. Arguments as :func:`gptq_matmul`; the backward
    dequantizes again in both cases (no dense weight is kept for it)."""
    _check("gptq_linear", x, weight, bias)
    rows = x.numel() // max(x.shape[-1], 1)
    limit = TUNING["max_rows"] if weight.group_size else TUNING["act_order_max_rows"]
    return _GPTQLinearFunction.apply(x, weight, bias, rows <= limit and use_triton(x.device))
