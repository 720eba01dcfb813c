"""Per-token log-probabilities and softmax statistics of a linear layer (the LM head), without the [N, V] logits.

``linear_log_probs(hidden, weight, target, bias=None, *, temperature, logit_scale, softcap, ...)`` scores the
distribution of ``x = hidden @ weight.T + bias`` transformed as

    z = softcap * tanh(logit_scale * x / softcap) / temperature          (softcap=None: logit_scale * x / temperature)

(the scale before the cap, the temperature after it) and returns, per row whose target is not ``ignore_index``:

    log_probs         log softmax(z)[target]                              differentiable
    entropy           -sum_j p_j log p_j                                  differentiable   (on request)
    log_sum_sq_probs  log sum_j p_j^2                                     no gradient      (on request)
    mean_logits       mean_j z_j                                          no gradient      (on request)
    is_top1           the target is the first argmax of z (bool)          no gradient      (on request)

Ignored rows get 0 (False) and no gradient, and cost no GEMM work. Rows are processed in chunks whose
[rows, V] logits stay under a memory budget (as ``linear_cross_entropy``); each chunk's gradient is written
into that chunk's own memory. The backward recomputes each chunk's logits (the forward keeps only the row
statistics), so no [N, V] tensor outlives a chunk; for a frozen head (only hidden needs a gradient: LoRA,
QLoRA) the forward computes each row's d log_probs / d hidden from the logits at hand instead, and the backward
scales it (2 GEMM passes instead of 3). An entropy that is differentiated too needs the recomputing backward (its
row gradient depends on the entropy, known only after a pass over the row); with ``entropy_grad=True`` (an entropy
bonus will differentiate it) a frozen head's forward therefore computes nothing for the backward beyond the row
statistics (3 GEMM passes and 2 passes over the logits in all, instead of 4 and 3). Under ``torch.no_grad()`` (or
with inputs that need no gradient) nothing is kept for a backward.

Gradient, with g = d/d log_probs and h = d/d entropy of row i and p = softmax(z):
    d/dz_j = g ([j == target] - p_j) - h p_j (log p_j + entropy)
and d z/d x = logit_scale * (1 - tanh^2) / temperature.

Precision follows ``linear_cross_entropy``: the GEMMs run in the autocast dtype under autocast, else in
hidden's dtype (a weight of another dtype is cast to it, as for an fp32 head over bf16 weights); the row
math is fp32; an fp32 master weight gets its gradient accumulated in fp32.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from foak.backend import use_triton
from foak.ops._checks import check_float_tensor, check_same_device
from foak.ops._custom_op import custom_op
from foak.ops.cross_entropy import _check_targets
from foak.ops.linear_cross_entropy import ACCUM_DTYPES, _compute_operands, _rows_per_chunk, _valid_rows, \
    _weight_gradient_gemm

OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class LogProbs(NamedTuple):
    """Per-row results (target's shape, fp32; is_top1 bool); None where not requested."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None


# 1. reference -------------------------------------------------------------------------------------
def transformed_logits(x: torch.Tensor, temperature=1.0, logit_scale=1.0, softcap=None) -> torch.Tensor:
    """fp32 z from raw logits x (see the module docstring)."""
    z = x.float() * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def linear_log_probs_reference(hidden, weight, target, bias=None, *, temperature=1.0, logit_scale=1.0,
                               softcap=None, ignore_index=-100, entropy=False, log_sum_sq_probs=False,
                               mean_logits=False, is_top1=False) -> LogProbs:
    """Materialises the logits in fp32 (ground truth for tests); differentiable through torch autograd."""
    x = hidden.reshape(-1, hidden.shape[-1]).float() @ weight.float().t()
    if bias is not None:
        x = x + bias.float()
    z = transformed_logits(x, temperature, logit_scale, softcap)
    t = target.reshape(-1)
    valid = t != ignore_index
    safe = torch.where(valid, t, torch.zeros_like(t)).long()
    log_p = torch.log_softmax(z, dim=-1)
    zero = torch.zeros((), device=z.device)

    def rows(values):
        return torch.where(valid, values, zero).view(target.shape)

    return LogProbs(
        rows(log_p.gather(1, safe[:, None]).squeeze(1)),
        rows(-(log_p.exp() * log_p).sum(-1)) if entropy else None,
        rows(torch.logsumexp(2 * log_p, dim=-1)).detach() if log_sum_sq_probs else None,
        rows(z.mean(-1)).detach() if mean_logits else None,
        (valid & (z.argmax(-1) == safe)).view(target.shape) if is_top1 else None,
    )


# 2. kernels ---------------------------------------------------------------------------------------
@triton.jit
def _z(x, logit_scale, softcap, inv_temperature, HAS_SOFTCAP: tl.constexpr):
    """z from fp32 raw logits x, and tanh(logit_scale * x / softcap) (for the softcap's derivative)."""
    y = x * logit_scale
    if HAS_SOFTCAP:
        th = 2.0 * tl.sigmoid(2.0 * y / softcap) - 1.0  # tanh without libdevice (runs in the interpreter)
        return softcap * th * inv_temperature, th
    return y * inv_temperature, y


@triton.jit
def _forward_kernel(
    LOGITS, logits_stride, TARGET, LOGP, STATS, ENT, SQ, MEAN, TOP1, n_rows, n_cols, logit_scale, softcap,
    inv_temperature, HAS_SOFTCAP: tl.constexpr, HAS_ENTROPY: tl.constexpr, HAS_SQ: tl.constexpr,
    HAS_MEAN: tl.constexpr, HAS_TOP1: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per row, one pass over its logits (a chunk's logits are larger than L2: a second pass
    # would read them from memory again). Per lane, relative to the lane's running max m:
    #   s = sum exp(z - m),  u = sum exp(z - m) (z - m) <= 0,  q = sum exp(2 (z - m)),
    # rescaled when m grows; then entropy = log S - U / S and log sum p^2 = log Q - 2 log S over the row.
    # u's terms are all <= 0, so the entropy (log S + |U| / S) has no cancellation.
    LOG2E: tl.constexpr = 1.4426950408889634
    row = tl.program_id(0).to(tl.int64)
    x_row = LOGITS + row * logits_stride
    target = tl.load(TARGET + row).to(tl.int32)
    cols = tl.arange(0, BLOCK)
    m_lane = tl.zeros([BLOCK], dtype=tl.float32) - float("inf")
    s_lane = tl.zeros([BLOCK], dtype=tl.float32)
    u_lane = tl.zeros([BLOCK], dtype=tl.float32)
    q_lane = tl.zeros([BLOCK], dtype=tl.float32)
    i_lane = tl.zeros([BLOCK], dtype=tl.int32)
    sum_lane = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(tl.cdiv(n_cols, BLOCK)):
        c = i * BLOCK + cols
        mask = c < n_cols
        z, _th = _z(tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32), logit_scale, softcap, inv_temperature,
                    HAS_SOFTCAP)
        if HAS_MEAN:
            sum_lane += tl.where(mask, z, 0.0)
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m_lane, z)
        seen = m_new > float("-inf")  # lanes that saw only padding keep s = u = q = 0 (no -inf - -inf)
        shift = tl.where(seen, m_new, 0.0)
        grow = tl.where(seen, m_lane - shift, 0.0)  # <= 0: how far the old max lies below the new one
        rescale = tl.exp2(grow * LOG2E)
        d = tl.where(mask & seen, z - shift, 0.0)
        e = tl.where(mask & seen, tl.exp2(d * LOG2E), 0.0)
        if HAS_ENTROPY:  # (a lane's first value: grow = -inf, s = 0, rescale = 0)
            u_lane = rescale * (u_lane + tl.where(s_lane > 0, grow * s_lane, 0.0)) + e * d
        if HAS_SQ:
            q_lane = q_lane * rescale * rescale + e * e
        s_lane = s_lane * rescale + e
        if HAS_TOP1:
            i_lane = tl.where(z > m_lane, c, i_lane)  # strict: each lane keeps its first maximum
        m_lane = m_new
    m = tl.max(m_lane, axis=0)
    lane_gap = tl.where(s_lane > 0, m_lane - m, 0.0)
    r = tl.where(s_lane > 0, tl.exp2(lane_gap * LOG2E), 0.0)
    s = tl.sum(s_lane * r, axis=0)
    log_s = tl.log(s)
    z_t, _th_t = _z(tl.load(x_row + target).to(tl.float32), logit_scale, softcap, inv_temperature, HAS_SOFTCAP)
    tl.store(LOGP + row, (z_t - m) - log_s)
    tl.store(STATS + row, m)
    tl.store(STATS + n_rows + row, log_s)
    if HAS_ENTROPY:
        tl.store(ENT + row, log_s - tl.sum(r * (u_lane + lane_gap * s_lane), axis=0) / s)
    if HAS_SQ:
        tl.store(SQ + row, tl.log(tl.sum(q_lane * r * r, axis=0)) - 2.0 * log_s)
    if HAS_MEAN:
        tl.store(MEAN + row, tl.sum(sum_lane, axis=0) / n_cols)
    if HAS_TOP1:
        first = tl.min(tl.where(m_lane == m, i_lane, 2147483647), axis=0)
        tl.store(TOP1 + row, tl.where(first == target, 1.0, 0.0))


@triton.jit
def _backward_kernel(
    LOGITS, logits_stride, OUT, out_stride, TARGET, STATS, ENT, D_LOGP, D_ENT, n_rows, n_cols, logit_scale,
    softcap, inv_temperature, HAS_SOFTCAP: tl.constexpr, HAS_D_LOGP: tl.constexpr, HAS_D_ENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # writes d(loss)/d(logits) of the row to OUT (the logits themselves when OUT is LOGITS)
    LOG2E: tl.constexpr = 1.4426950408889634
    row = tl.program_id(0).to(tl.int64)
    x_row = LOGITS + row * logits_stride
    out_row = OUT + row * out_stride
    target = tl.load(TARGET + row).to(tl.int32)
    m = tl.load(STATS + row)
    log_s = tl.load(STATS + n_rows + row)
    if HAS_D_LOGP:
        d_logp = tl.load(D_LOGP + row).to(tl.float32)
    if HAS_D_ENT:
        d_ent = tl.load(D_ENT + row).to(tl.float32)
        entropy = tl.load(ENT + row)
    # d z / d x, the factor common to every column (the softcap's part is per column)
    chain = logit_scale * inv_temperature
    cols = tl.arange(0, BLOCK)
    for i in range(tl.cdiv(n_cols, BLOCK)):
        c = i * BLOCK + cols
        mask = c < n_cols
        z, th = _z(tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32), logit_scale, softcap, inv_temperature,
                   HAS_SOFTCAP)
        log_p = (z - m) - log_s
        p = tl.exp2(log_p * LOG2E)
        g = tl.zeros([BLOCK], dtype=tl.float32)
        if HAS_D_LOGP:
            g += d_logp * (tl.where(c == target, 1.0, 0.0) - p)
        if HAS_D_ENT:
            g -= d_ent * p * (log_p + entropy)
        g = g * chain
        if HAS_SOFTCAP:
            g = g * (1.0 - th * th)
        tl.store(out_row + c, g.to(OUT.dtype.element_ty), mask=mask)


# 3. launchers -------------------------------------------------------------------------------------
# Launch knobs (as ops/cross_entropy.py's row kernel: one program per row, the vocabulary in blocks). The
# forward keeps per-lane state for each requested statistic; "forward_blocks"[p] is its block for a register
# pressure p = statistics requested + softcap (capped at 3): at 32 warps these are the largest blocks that do not
# spill registers on sm_90 with Triton 3.6 and 3.9 (16384 spilled 240 bytes per thread for DPO's request, 120 for a
# softcapped reference forward; tests/test_register_spills.py compiles them, figures in
# benchmarks/results/register_spills_sm90.log).
TUNING = {"block": 16384, "warps": 32, "forward_blocks": (16384, 8192, 8192, 4096)}


def _launch_config(n_cols: int, pressure: int | None = None) -> dict:
    """(BLOCK, num_warps) for the backward kernel, or for the forward kernel at register ``pressure``."""
    block = TUNING["block"] if pressure is None else TUNING["forward_blocks"][min(pressure, 3)]
    block = min(block, triton.next_power_of_2(n_cols))
    return dict(BLOCK=block, num_warps=min(TUNING["warps"], max(4, block // 128)))


def _forward_pressure(entropy, log_sum_sq_probs, mean_logits, is_top1, softcap) -> int:
    return int(entropy) + int(log_sum_sq_probs) + int(mean_logits) + int(is_top1) + int(softcap is not None)


def _transform_args(temperature, logit_scale, softcap):
    return (float(logit_scale), float(softcap or 1.0), 1.0 / float(temperature))


def _chunks(hidden, weight, bias, valid, chunk_bytes):
    """Yields (start, end, rows, h, logits) per chunk of the valid rows, with one set of reused buffers."""
    n_valid = valid.numel()
    rows_per_chunk = _rows_per_chunk(weight.shape[0], hidden.element_size(), chunk_bytes)
    step = min(rows_per_chunk, max(n_valid, 1))
    logits_buf = hidden.new_empty((step, weight.shape[0]))
    h_buf = hidden.new_empty((step, hidden.shape[1]))
    for start in range(0, n_valid, step):
        end = min(start + step, n_valid)
        rows = valid[start:end]
        h = torch.index_select(hidden, 0, rows, out=h_buf[: end - start])
        logits = logits_buf[: end - start]
        if bias is not None:
            torch.addmm(bias, h, weight.t(), out=logits)
        else:
            torch.mm(h, weight.t(), out=logits)
        yield start, end, rows, h, logits


def _scatter(values, valid, n):
    return values.new_zeros(n).index_copy_(0, valid, values)


# 4. custom ops and autograd -----------------------------------------------------------------------
def _forward_fake(hidden, weight, bias, target, temperature, logit_scale, softcap, ignore_index, entropy,
                  log_sum_sq_probs, mean_logits, is_top1, input_grad, chunk_bytes):
    n = hidden.shape[0]
    rows = hidden.new_empty(n, dtype=torch.float32)

    def extra(wanted):
        return rows.new_empty(n if wanted else 0)

    return (rows, rows.new_empty((2, n)), extra(entropy), extra(log_sum_sq_probs), extra(mean_logits),
            extra(is_top1), hidden.new_empty(hidden.shape if input_grad else 0))


@custom_op("linear_log_probs_forward", _forward_fake)
def _forward_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
    temperature: float, logit_scale: float, softcap: float | None, ignore_index: int, entropy: bool,
    log_sum_sq_probs: bool, mean_logits: bool, is_top1: bool, input_grad: bool, chunk_bytes: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row log-probs, stats ([2, N]: row max of z and log sum exp(z - max)) and the requested extras
    (empty where not requested; is_top1 as 0./1.), all fp32, 0 on ignored rows. hidden, weight and bias
    share the GEMM dtype. ``input_grad``: also d log_probs / d hidden for each row ([N, H] in hidden's dtype,
    0 on ignored rows; else empty), computed from the chunk's logits while they are at hand."""
    n = hidden.shape[0]
    valid = _valid_rows(target, ignore_index)
    n_valid = valid.numel()
    f32 = dict(dtype=torch.float32, device=hidden.device)
    logp, stats = torch.empty(n_valid, **f32), torch.empty((2, n_valid), **f32)
    wanted = (entropy, log_sum_sq_probs, mean_logits, is_top1)
    extras = [torch.empty(n_valid if w else 0, **f32) for w in wanted]
    dummy = stats  # pointer for outputs not computed
    d_input = torch.zeros_like(hidden) if input_grad else hidden.new_empty(0)
    unit = torch.ones(n_valid, **f32) if input_grad else None  # d log_probs = 1 for every scored row
    transform = _transform_args(temperature, logit_scale, softcap)
    pressure = _forward_pressure(entropy, log_sum_sq_probs, mean_logits, is_top1, softcap)
    for start, end, rows, _h, logits in _chunks(hidden, weight, bias, valid, chunk_bytes):
        count = end - start
        chunk = [e[start:end] if w else dummy for e, w in zip(extras, wanted)]
        chunk_stats = torch.empty((2, count), **f32)
        chunk_target = target.index_select(0, rows)
        _forward_kernel[(count,)](
            logits, logits.stride(0), chunk_target, logp[start:end], chunk_stats, *chunk, count, logits.shape[1],
            *transform, HAS_SOFTCAP=softcap is not None, HAS_ENTROPY=entropy, HAS_SQ=log_sum_sq_probs,
            HAS_MEAN=mean_logits, HAS_TOP1=is_top1, **_launch_config(logits.shape[1], pressure))
        if input_grad:  # the backward's logits gradient for d log_probs = 1, then its input projection
            _backward_kernel[(count,)](
                logits, logits.stride(0), logits, logits.stride(0), chunk_target, chunk_stats, dummy,
                unit[start:end], dummy, count, logits.shape[1],
                *transform, HAS_SOFTCAP=softcap is not None, HAS_D_LOGP=True, HAS_D_ENT=False,
                **_launch_config(logits.shape[1]))
            d_input.index_copy_(0, rows, logits @ weight)
        stats[:, start:end] = chunk_stats
    full_stats = stats.new_zeros((2, n)).index_copy_(1, valid, stats)
    return (_scatter(logp, valid, n), full_stats,
            *(_scatter(e, valid, n) if w else e for e, w in zip(extras, wanted)), d_input)


def _backward_fake(d_logp, d_ent, hidden, weight, bias, target, stats, ent, temperature, logit_scale, softcap,
                   ignore_index, want_dh, want_dw, want_db, dw_fp32, chunk_bytes):
    return (hidden.new_empty(hidden.shape if want_dh else 0), weight.new_empty(weight.shape if want_dw else 0),
            weight.new_empty(weight.shape[0] if want_db else 0, dtype=torch.float32))


@custom_op("linear_log_probs_backward", _backward_fake)
def _backward_op(
    d_logp: torch.Tensor, d_ent: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
    bias: torch.Tensor | None, target: torch.Tensor, stats: torch.Tensor, ent: torch.Tensor, temperature: float,
    logit_scale: float, softcap: float | None, ignore_index: int, want_dh: bool, want_dw: bool, want_db: bool,
    dw_fp32: bool, chunk_bytes: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of hidden, weight (in its own dtype) and bias (fp32), empty where not wanted, for the per-row
    incoming gradients d_logp and d_ent ([N] fp32, or empty: none)."""
    valid = _valid_rows(target, ignore_index)
    w, b, accumulate = _compute_operands(hidden, weight, bias, dw_fp32)
    dh = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device) if want_dh else None
    # the first chunk's GEMM writes dw; later ones accumulate into it
    dw = (torch.empty(weight.shape, dtype=accumulate, device=weight.device) if valid.numel()
          else torch.zeros(weight.shape, dtype=accumulate, device=weight.device)) if want_dw else None
    db = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if want_db else None
    has_d_logp, has_d_ent = d_logp.numel() > 0, d_ent.numel() > 0
    d_logp_v = d_logp.float().index_select(0, valid) if has_d_logp else stats
    d_ent_v = d_ent.float().index_select(0, valid) if has_d_ent else stats
    stats_v = stats.index_select(1, valid).contiguous()
    ent_v = ent.index_select(0, valid) if has_d_ent else stats
    for start, end, rows, h, logits in _chunks(hidden, w, b, valid, chunk_bytes):
        count = end - start
        _backward_kernel[(count,)](
            logits, logits.stride(0), logits, logits.stride(0), target.index_select(0, rows),
            stats_v[:, start:end].contiguous(),
            ent_v[start:end] if has_d_ent else stats, d_logp_v[start:end] if has_d_logp else stats,
            d_ent_v[start:end] if has_d_ent else stats, count, logits.shape[1],
            *_transform_args(temperature, logit_scale, softcap), HAS_SOFTCAP=softcap is not None,
            HAS_D_LOGP=has_d_logp, HAS_D_ENT=has_d_ent, **_launch_config(logits.shape[1]))
        if want_dh:
            dh.index_copy_(0, rows, logits @ w)
        if want_dw:
            _weight_gradient_gemm(dw, logits.t(), h, first=start == 0)
        if want_db:
            db += logits.sum(0, dtype=torch.float32)
    if dw is not None and dw.dtype != weight.dtype:
        dw = dw.to(weight.dtype)
    return (dh if dh is not None else hidden.new_empty(0), dw if dw is not None else weight.new_empty(0),
            db if db is not None else weight.new_empty(0, dtype=torch.float32))


class _LinearLogProbsFunction(torch.autograd.Function):
    """hidden in the GEMM dtype; weight and bias the caller's (the op casts them and returns their gradients
    in their own dtypes). Saves the inputs and the row statistics, never logits.

    A frozen head (only hidden needs a gradient: LoRA, QLoRA) also gets d log_probs / d hidden of each row
    in the forward, from the logits the forward computed anyway: the gradient is linear in each row's
    incoming d_logp, so the backward is one scaling (no recomputed logits, 2 GEMMs in all instead of 3),
    for one [N, H] tensor kept until then. An entropy that receives a gradient takes the recomputing backward
    (so does any call under torch.compile, whose autograd sends the entropy's unused gradient as zeros): the
    caller passes ``input_grad=False`` when it expects one (3 GEMMs in all), else the forward's row gradient
    was computed for nothing (4)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, params, wanted, dw_fp32, chunk_bytes, input_grad):
        # input_grad: compute d log_probs / d hidden in the forward (only hidden needs a gradient, and the caller
        # expects no gradient on the entropy)
        ctx.set_materialize_grads(False)  # an entropy only logged sends no zeros back
        ctx.params, ctx.dw_fp32, ctx.chunk_bytes = params, dw_fp32, chunk_bytes
        ctx.bias_dtype = bias.dtype if bias is not None else None
        w, b, _ = _compute_operands(hidden, weight, bias, dw_fp32)
        logp, stats, ent, sq, mean, top1, d_input = _forward_op(
            hidden, w, b, target, *params, *wanted, input_grad, chunk_bytes)
        ctx.save_for_backward(hidden, weight, bias, target, stats, ent, d_input if input_grad else None)
        ctx.mark_non_differentiable(stats, sq, mean, top1)
        return logp, stats, ent, sq, mean, top1

    @staticmethod
    def backward(ctx, d_logp, _d_stats, d_ent, *_):
        want = tuple(ctx.needs_input_grad[:3])
        if (d_logp is None and d_ent is None) or not any(want):
            return (None,) * 9
        hidden, weight, bias, target, stats, ent, d_input = ctx.saved_tensors
        if d_input is not None and d_ent is None:
            # a frozen head: d_input holds each row's gradient for d_logp = 1
            dh = (d_input.float() * d_logp.float()[:, None]).to(hidden.dtype)
            return dh, None, None, None, None, None, None, None, None
        empty = stats.new_empty(0)
        grads = _backward_op(d_logp.contiguous() if d_logp is not None else empty,
                             d_ent.contiguous() if d_ent is not None else empty, hidden, weight, bias, target, stats,
                             ent, *ctx.params, *want, ctx.dw_fp32, ctx.chunk_bytes)
        dh, dw, db = (g if w else None for g, w in zip(grads, want))
        if db is not None:
            db = db.to(ctx.bias_dtype)
        return dh, dw, db, None, None, None, None, None, None


# 5. public function -------------------------------------------------------------------------------
def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    entropy: bool = False,
    log_sum_sq_probs: bool = False,
    mean_logits: bool = False,
    is_top1: bool = False,
    accum_dtype: torch.dtype | None = None,
    chunk_bytes: int | None = None,
    entropy_grad: bool = False,
) -> LogProbs:
    """Per-row log-probability of ``target`` under softmax(z) of ``hidden @ weight.T + bias`` and the
    requested statistics (see the module docstring), as a :class:`LogProbs` of target's shape.

    hidden ``[..., H]``, target ``[...]`` (int), weight ``[V, H]``, bias ``[V]`` or None. log_probs and
    entropy are differentiable (w.r.t. hidden, weight and bias). ``accum_dtype=torch.float32`` accumulates a
    bf16/fp16 weight's gradient in fp32 across chunks; ``chunk_bytes`` bounds one [rows, V] logits chunk
    (default: ``linear_cross_entropy``'s budget). ``entropy_grad=True`` says that the entropy will be
    differentiated (an entropy bonus): a frozen head's forward then leaves the whole gradient to the
    recomputing backward (see the module docstring); a wrong hint costs time, never correctness.
    """
    op = "linear_log_probs"
    check_float_tensor(op, "hidden", hidden)
    check_float_tensor(op, "weight", weight)
    check_same_device(op, hidden=hidden, weight=weight, bias=bias, target=target)
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: expected hidden [..., H] and weight [V, H]; got hidden {tuple(hidden.shape)} and "
                         f"weight {tuple(weight.shape)}")
    if bias is not None:
        check_float_tensor(op, "bias", bias)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"{op}: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if not isinstance(target, torch.Tensor) or target.shape != hidden.shape[:-1]:
        got = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
        raise ValueError(f"{op}: target must have hidden's leading shape {tuple(hidden.shape[:-1])}, got {got}")
    for name, value in (("temperature", temperature), ("logit_scale", logit_scale)):
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{op}: {name} must be a finite number, got {value!r}")
    if temperature == 0:
        raise ValueError(f"{op}: temperature must be non-zero (z is divided by it)")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{op}: softcap must be None or > 0, got {softcap}")
    if accum_dtype not in ACCUM_DTYPES:
        raise ValueError(f"{op}: accum_dtype must be None (the weight's dtype) or torch.float32, got {accum_dtype!r}")
    if chunk_bytes is not None and (not isinstance(chunk_bytes, int) or chunk_bytes <= 0):
        raise ValueError(f"{op}: chunk_bytes must be a positive int (bytes of one logits chunk), got {chunk_bytes!r}")
    if entropy_grad and not entropy:
        raise ValueError(f"{op}: entropy_grad=True needs entropy=True (it says the entropy will be differentiated)")
    n_rows = target.numel()
    if n_rows:
        _check_targets(op, target, n_rows, weight.shape[0], ignore_index, hidden.device)
    elif target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{op}: target must be an int64 or int32 tensor, got {target.dtype}")
    wanted = (bool(entropy), bool(log_sum_sq_probs), bool(mean_logits), bool(is_top1))
    params = (float(temperature), float(logit_scale), None if softcap is None else float(softcap), int(ignore_index))
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # the GEMMs in the autocast dtype, as nn.Linear under autocast
        hidden = hidden.to(torch.get_autocast_dtype(device_type))
    if not use_triton(hidden.device):
        return linear_log_probs_reference(hidden, weight, target, bias, temperature=params[0],
                                          logit_scale=params[1], softcap=params[2], ignore_index=params[3],
                                          entropy=wanted[0], log_sum_sq_probs=wanted[1], mean_logits=wanted[2],
                                          is_top1=wanted[3])
    hidden2, target1 = hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1)
    dw_fp32 = accum_dtype is torch.float32
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    with torch.autocast(device_type, enabled=False):
        if needs_grad:
            input_grad = hidden2.requires_grad and not weight.requires_grad and not (
                bias is not None and bias.requires_grad) and not entropy_grad
            logp, _, ent, sq, mean, top1 = _LinearLogProbsFunction.apply(
                hidden2, weight, bias, target1, params, wanted, dw_fp32, chunk_bytes, input_grad)
        else:  # nothing saved for a backward
            w, b, _ = _compute_operands(hidden2, weight, bias, dw_fp32)
            logp, _, ent, sq, mean, top1, _ = _forward_op(hidden2, w, b, target1, *params, *wanted, False,
                                                          chunk_bytes)
    shape = target.shape
    return LogProbs(logp.view(shape), *(e.view(shape) if w else None for e, w in zip((ent, sq, mean), wanted[:3])),
                    top1.view(shape).bool() if wanted[3] else None)
