"""Rotary position embedding for q and k in one launch (GQA, packed sequences, partial rotary).

HF convention ("rotate_half" layout): with ``x = [x1, x2]`` split at half the rotary dim ``R``,
``y = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]``. ``cos``/``sin`` hold ``R``
values per position (HF repeats the ``R/2`` frequencies twice). Dimensions ``R..D`` of each head pass
through unchanged (partial rotary). The backward is the inverse rotation.

``interleaved=True`` (GLM's layout): the rotated pairs are adjacent, ``(x[2i], x[2i+1])``, turned by the angle
of frequency ``i``: ``y = x * c + rotate_pairs(x) * s`` with ``rotate_pairs(x)[2i:2i+2] = [-x[2i+1], x[2i]]``
and ``c = repeat_interleave(cos[..., :R/2], 2)`` (likewise ``s``): only the first ``R/2`` values of cos/sin
are read, as GLM's ``apply_rotary_pos_emb`` does.

Two ways to give positions:
- ``cos``, ``sin`` of shape ``[B or 1, S, R]``, already gathered per position (what HF's rotary
  embedding module returns: packed sequences are handled by the position_ids it was given);
- tables ``cos``, ``sin`` of shape ``[P, R]`` plus ``position_ids [B or 1, S]`` (int), gathered in
  the kernel; positions may restart anywhere inside a row (packed sequences).

The op is out of place: q and k are never modified (autograd may still need them).

Dtypes follow HF's ``q * cos + rotate_half(q) * sin``: the outputs have the promoted dtype of (q, cos)
(under autocast over fp32 weights q/k come from bf16 linears and cos/sin are fp32, so the outputs are
fp32, as in HF), and the gradients of q and k have their own dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foak.backend import use_triton
from foak.ops._checks import check_float_tensor, check_same_device, check_same_dtype
from foak.ops._custom_op import custom_op

# Launch knob (None = heuristic), swept on the GPU by benchmarks/tune_ops.py (2-8 warps within 5%).
TUNING = {"warps": None}


# 1. reference -------------------------------------------------------------------------------------
def _gather(cos, sin, position_ids):
    if position_ids is None:
        return cos, sin
    return cos[position_ids], sin[position_ids]  # [B or 1, S, R]


def rope_reference(q, k, cos, sin, position_ids=None, interleaved=False):
    """The math in plain torch (fp32 inside, cast to the promoted dtype of q and cos). Returns (q_out, k_out)."""
    out_dtype = torch.promote_types(q.dtype, cos.dtype)
    cos, sin = _gather(cos, sin, position_ids)
    cos = cos.float().unsqueeze(1)  # broadcast over heads
    sin = sin.float().unsqueeze(1)
    rot = cos.shape[-1]
    if interleaved:  # frequency i turns the adjacent pair (2i, 2i+1)
        cos = cos[..., : rot // 2].repeat_interleave(2, dim=-1)
        sin = sin[..., : rot // 2].repeat_interleave(2, dim=-1)

    def rotate(x):
        xf = x.float()
        xr, xpass = xf[..., :rot], xf[..., rot:]
        if interleaved:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            turned = torch.stack((-x2, x1), dim=-1).flatten(-2)
        else:
            x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
            turned = torch.cat((-x2, x1), dim=-1)
        out = xr * cos + turned * sin
        return torch.cat((out, xpass), dim=-1).to(out_dtype)

    return rotate(q), rotate(k)


# 2. kernels ---------------------------------------------------------------------------------------
@triton.jit
def _rotate_heads(
    X, x_sb, x_sh, x_ss, XO, xo_sb, xo_sh, xo_ss, b, s, n_heads, half, head_dim,
    a1, b1, a2, b2,
    INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    # y1 = x1 * a1 + x2 * b1 ; y2 = x2 * a2 + x1 * b2 for every head at one (batch, position); the pair
    # (x1, x2) of frequency d is (d, half + d), or (2d, 2d + 1) when INTERLEAVED
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < n_heads) & (d < half)
    # int64 head offsets: in a contiguous [B, 32, L, 128] q (or gradient) head 31 starts past 2**31 elements
    # from L = 541,201 on. Strides are never negative: knowing it, the compiler forms each product with one
    # 32 x 32 -> 64-bit multiply (as many instructions as the int32 offsets took)
    tl.assume(x_sh >= 0)
    tl.assume(xo_sh >= 0)
    hl = h.to(tl.int64)
    src = X + b * x_sb + s * x_ss + hl * x_sh
    dst = XO + b * xo_sb + s * xo_ss + hl * xo_sh
    if INTERLEAVED:
        first = 2 * d
        second = 2 * d + 1
    else:
        first = d
        second = half + d
    x1 = tl.load(src + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + first, (x1 * a1 + x2 * b1).to(XO.dtype.element_ty), mask=mask)
    tl.store(dst + second, (x2 * a2 + x1 * b2).to(XO.dtype.element_ty), mask=mask)
    if BLOCK_PASS > 0:  # partial rotary: the tail of each head is copied unchanged
        p = 2 * half + tl.arange(0, BLOCK_PASS)[None, :]
        pmask = (h < n_heads) & (p < head_dim)
        tl.store(dst + p, tl.load(src + p, mask=pmask, other=0.0).to(XO.dtype.element_ty), mask=pmask)


@triton.jit
def _rope_kernel(
    Q, q_sb, q_sh, q_ss, QO, qo_sb, qo_sh, qo_ss,
    K, k_sb, k_sh, k_ss, KO, ko_sb, ko_sh, ko_ss,
    COS, SIN, cs_sb, cs_ss, POS, pos_sb, pos_ss,
    seq_len, n_q_heads, n_k_heads, half, head_dim,
    HAS_POS: tl.constexpr, BACKWARD: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // seq_len
    s = pid % seq_len
    if HAS_POS:
        row = tl.load(POS + b * pos_sb + s * pos_ss).to(tl.int64) * cs_ss
    else:
        row = b * cs_sb + s * cs_ss
    d = tl.arange(0, BLOCK_HALF)[None, :]
    dmask = d < half
    c1 = tl.load(COS + row + d, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + row + d, mask=dmask, other=0.0).to(tl.float32)
    if INTERLEAVED:  # one angle per pair: the first half of cos/sin (GLM reads only that half)
        c2 = c1
        s2 = s1
    else:
        c2 = tl.load(COS + row + half + d, mask=dmask, other=0.0).to(tl.float32)
        s2 = tl.load(SIN + row + half + d, mask=dmask, other=0.0).to(tl.float32)
    # forward: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2; backward (transpose): dx1 = dy1 c1 + dy2 s2,
    # dx2 = dy2 c2 - dy1 s1
    if BACKWARD:
        b1 = s2
        b2 = -s1
    else:
        b1 = -s1
        b2 = s2
    _rotate_heads(Q, q_sb, q_sh, q_ss, QO, qo_sb, qo_sh, qo_ss, b, s, n_q_heads, half, head_dim,
                  c1, b1, c2, b2, INTERLEAVED, BLOCK_HQ, BLOCK_HALF, BLOCK_PASS)
    _rotate_heads(K, k_sb, k_sh, k_ss, KO, ko_sb, ko_sh, ko_ss, b, s, n_k_heads, half, head_dim,
                  c1, b1, c2, b2, INTERLEAVED, BLOCK_HK, BLOCK_HALF, BLOCK_PASS)


# 3. launcher --------------------------------------------------------------------------------------
def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _out_dtype(q, cos, backward: bool, out_dtype):
    if out_dtype is not None:
        return out_dtype
    return q.dtype if backward else torch.promote_types(q.dtype, cos.dtype)


def _launch(q, k, cos, sin, position_ids, backward: bool, out_dtype: torch.dtype | None = None,
            interleaved: bool = False):
    """Rotates q, k (the backward: dq_out, dk_out) into new tensors of ``out_dtype`` (default: the
    promoted dtype of q and cos forward, q's dtype backward)."""
    out_dtype = _out_dtype(q, cos, backward, out_dtype)
    q, k = _unit_last(q), _unit_last(k)
    cos, sin = _unit_last(cos), _unit_last(sin)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    batch, n_q_heads, seq_len, head_dim = q.shape
    n_k_heads = k.shape[1]
    half = cos.shape[-1] // 2
    # empty_like keeps q's layout (e.g. [B,S,H,D] storage)
    q_out, k_out = torch.empty_like(q, dtype=out_dtype), torch.empty_like(k, dtype=out_dtype)
    if position_ids is not None:
        pos = position_ids
        pos_sb = pos.stride(0) if pos.shape[0] > 1 else 0
        pos_ss, cs_sb, cs_ss = pos.stride(1), 0, cos.stride(0)
    else:
        pos, pos_sb, pos_ss = cos, 0, 0  # unused (HAS_POS=False)
        cs_sb = cos.stride(0) if cos.shape[0] > 1 else 0
        cs_ss = cos.stride(1)
    block_half = triton.next_power_of_2(half)
    block_pass = triton.next_power_of_2(head_dim - 2 * half) if head_dim > 2 * half else 0
    elems = (triton.next_power_of_2(n_q_heads) + triton.next_power_of_2(n_k_heads)) * block_half * 2
    num_warps = TUNING["warps"] or (8 if elems >= 8192 else 4)
    if batch * seq_len and (n_q_heads or n_k_heads):
        _rope_kernel[(batch * seq_len,)](
            q, q.stride(0), q.stride(1), q.stride(2), q_out, q_out.stride(0), q_out.stride(1), q_out.stride(2),
            k, k.stride(0), k.stride(1), k.stride(2), k_out, k_out.stride(0), k_out.stride(1), k_out.stride(2),
            cos, sin, cs_sb, cs_ss, pos, pos_sb, pos_ss,
            seq_len, n_q_heads, n_k_heads, half, head_dim,
            HAS_POS=position_ids is not None, BACKWARD=backward, INTERLEAVED=interleaved,
            # (a k of no heads: q alone is rotated, e.g. Gemma 4's one-tensor calls)
            BLOCK_HQ=triton.next_power_of_2(max(n_q_heads, 1)), BLOCK_HK=triton.next_power_of_2(max(n_k_heads, 1)),
            BLOCK_HALF=block_half, BLOCK_PASS=block_pass, num_warps=num_warps,
        )
    return q_out, k_out


# 4. custom op and autograd ------------------------------------------------------------------------
def _rope_fake(q, k, cos, sin, position_ids, backward, out_dtype=None, interleaved=False):
    dtype = _out_dtype(q, cos, backward, out_dtype)
    return torch.empty_like(_unit_last(q), dtype=dtype), torch.empty_like(_unit_last(k), dtype=dtype)


@custom_op("rope", _rope_fake)
def _rope_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    position_ids: torch.Tensor | None, backward: bool, out_dtype: torch.dtype | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(q, k, cos, sin, position_ids, backward, out_dtype, interleaved)


class _RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids, interleaved):
        q_out, k_out = _rope_op(q, k, cos, sin, position_ids, False, None, interleaved)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.input_dtype = q.dtype  # q and k share it (checked)
        ctx.interleaved = interleaved
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        cos, sin, position_ids = ctx.saved_tensors
        dq, dk = _rope_op(dq_out, dk_out, cos, sin, position_ids, True, ctx.input_dtype, ctx.interleaved)
        return dq, dk, None, None, None, None


# 5. public function -------------------------------------------------------------------------------
def _validate(q, k, cos, sin, position_ids) -> None:
    op = "rope"
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_float_tensor(op, name, t)
    check_same_dtype(op, q=q, k=k)
    check_same_dtype(op, cos=cos, sin=sin)
    check_same_device(op, q=q, k=k, cos=cos, sin=sin, position_ids=position_ids)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"{op}: q and k must be 4-D [batch, heads, seq, head_dim]; got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        raise ValueError(
            f"{op}: q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, seq and head_dim "
            "(only the head count may differ)"
        )
    if cos.shape != sin.shape:
        raise ValueError(f"{op}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape")
    if cos.requires_grad or sin.requires_grad:
        raise ValueError(f"{op}: gradients w.r.t. cos/sin are not supported; pass them detached")
    batch, _, seq_len, head_dim = q.shape
    rot = cos.shape[-1]
    if rot % 2 or rot == 0 or rot > head_dim:
        raise ValueError(
            f"{op}: the rotary dim (last dim of cos/sin, {rot}) must be even, positive and <= head_dim ({head_dim})"
        )
    if position_ids is None:
        if cos.dim() != 3 or cos.shape[0] not in (1, batch) or cos.shape[1] != seq_len:
            raise ValueError(
                f"{op}: without position_ids, cos/sin must be [{batch} or 1, {seq_len}, rotary_dim]; "
                f"got {tuple(cos.shape)} (pass position_ids to index a [max_positions, rotary_dim] table)"
            )
        return
    if position_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: position_ids must be int32 or int64, got {position_ids.dtype}")
    if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != seq_len:
        raise ValueError(
            f"{op}: position_ids must be [{batch} or 1, {seq_len}]; got {tuple(position_ids.shape)}"
        )
    if cos.dim() != 2:
        raise ValueError(
            f"{op}: with position_ids, cos/sin must be tables [max_positions, rotary_dim]; got {tuple(cos.shape)}"
        )
    if position_ids.numel() and not torch.compiler.is_compiling():
        lo, hi = int(position_ids.min()), int(position_ids.max())
        if lo < 0 or hi >= cos.shape[0]:
            raise ValueError(
                f"{op}: position_ids span [{lo}, {hi}] but the cos/sin tables have {cos.shape[0]} positions"
            )


def rope(q, k, cos, sin, position_ids=None, interleaved=False):
    """Rotate q [B, Hq, S, D] and k [B, Hkv, S, D]; returns new tensors (q_out, k_out) of the promoted
    dtype of q and cos (HF's type promotion: fp32 for bf16 q with fp32 cos under autocast).
    ``interleaved``: GLM's layout of adjacent pairs (see the module docstring)."""
    _validate(q, k, cos, sin, position_ids)
    if not isinstance(interleaved, bool):
        raise ValueError(f"rope: interleaved must be a bool, got {interleaved!r}")
    if not use_triton(q.device):
        return rope_reference(q, k, cos, sin, position_ids, interleaved)
    return _RoPEFunction.apply(q, k, cos, sin, position_ids, interleaved)
