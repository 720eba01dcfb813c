"""The keep mask of foak's LoRA dropout, in Triton: element ``(t, j)`` of a ``[rows, n_cols]`` tensor is kept iff
``(philox(seed, t * ceil(n_cols / 4) + j // 4)[j % 4] >> 1) >= threshold`` (Philox-4x32-10 as ``tl.randint4x``;
``threshold = round(p * 2**31)``). foak.ops.lora documents it and holds its torch reference; the kernels of
foak.ops.lora (a row at a time) and foak.ops.lowrank (2-D tiles) generate it here, so they agree bit for bit."""

from __future__ import annotations

import triton
import triton.language as tl


def drop_threshold(p: float) -> int:
    """31-bit threshold: an element is kept iff its 31-bit random value is >= this."""
    return min(round(p * 2**31), 2**31 - 1)


@triton.jit
def keep_mask_row(seed, row, quads, n_quads, threshold):
    """[QUADS, 4] keep mask of row ``row``, columns ``4 * quads + (0..3)``."""
    r0, r1, r2, r3 = tl.randint4x(seed, row * n_quads + quads)
    lane = tl.arange(0, 4)[None, :]
    r = tl.where(lane == 0, r0[:, None],
                 tl.where(lane == 1, r1[:, None], tl.where(lane == 2, r2[:, None], r3[:, None])))
    return (r >> 1).to(tl.int32, bitcast=True) >= threshold


@triton.jit
def keep_mask_tile(seed, rows, col0, n_quads, threshold, BM: tl.constexpr, BC: tl.constexpr):
    """[BM, BC] keep mask of rows ``rows`` (int64) and columns ``col0 + (0..BC-1)``; ``col0`` a multiple of 4."""
    quads = col0 // 4 + tl.arange(0, BC // 4)
    r0, r1, r2, r3 = tl.randint4x(seed, rows[:, None] * n_quads + quads[None, :])
    # [BM, BC // 4, 2, 2] with element [., q, i, k] = r_(2i + k): row-major, column 4q + 2i + k takes r_(2i + k)
    r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (BM, BC))
    return (r >> 1).to(tl.int32, bitcast=True) >= threshold
