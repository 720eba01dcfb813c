"""Cross-entropy over a vocabulary, forward and backward, with the options LLM fine-tuning uses.

Per row ``i`` with target ``t`` (rows whose target is ``ignore_index`` contribute nothing):
    z      = softcap * tanh((logits / logits_scaling) / softcap)     (softcap=None: logits / logits_scaling)
    lse    = logsumexp(z)
    loss_i = w_t * (1 - eps) * (lse - z_t) + (eps / V) * sum_j w_j * (lse - z_j)     (eps = label_smoothing)
             + lse_square_scale * lse**2                              (z-loss)
where ``w`` is the optional per-class ``weight`` (torch semantics; all ones without it). Reductions: "none"
(per row, 0 where ignored), "sum", "mean" (sum / number of non-ignored rows, or / the sum of their target
weights ``w_t`` with ``weight``, as torch; 0 when every row is ignored, where torch returns NaN).
``num_items_in_batch`` (with "mean") divides the sum by that count instead, exactly as transformers'
``ForCausalLMLoss`` does, so gradient accumulation over micro-batches equals one large batch. Math is fp32
inside for any input dtype; the logsumexp keeps the row maximum and ``log(sum exp(z - max))`` apart, so
the gradient keeps its precision for logits far from 0 (a +1e4 offset, logits of +-1e4).

For "mean"/"sum" the kernel computes the gradient during the forward (one read of the logits, a second
read of each row while it is still in L2, one write of the gradient) and the backward only rescales it
when the incoming gradient is not 1 (checked on the device, no host sync). fp16 logits are the exception:
an fp16 gradient already divided by N underflows before a GradScaler's factor arrives, so for fp16 the
gradient is computed in the backward, with the incoming (scaled) gradient, like HF's fp32 loss does.
For "none" the backward makes one pass over the logits with the per-row incoming gradients. The gradient
lives in a new buffer, or in the logits' own memory with ``inplace_backward=True``.

``return_token_accuracy`` / ``return_entropy`` add per-row statistics for logging (what TRL logs as
``mean_token_accuracy`` and ``entropy``): 1.0 where the argmax of z (the first maximum) is the target, and
the entropy of softmax(z); both 0 on ignored rows, reduced like the loss (mean over non-ignored rows).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from foak.backend import use_triton
from foak.ops._checks import check_float_tensor, check_same_device
from foak.ops._custom_op import custom_op
from foak.ops._inplace import claim

REDUCTIONS = ("mean", "sum", "none")
MAX_VOCAB = 1 << 20
# Launch knobs, swept on the GPU by benchmarks/tune_ops.py ([8192, 128256] bf16 on the H200: one program
# per row, blocks of 16384 with 32 warps and a per-lane logsumexp were fastest, 2.46 ms fwd+bwd). A forward
# that keeps more per-lane state (row statistics: 2, softcap: 1, label smoothing: 1; 2 or more) spilled 120-370
# bytes of registers per thread at 16384 on sm_90 (Triton 3.6 and 3.9): it takes "block_stats", which spills at
# most 8 (tests/test_register_spills.py; benchmarks/results/register_spills_sm90.log).
TUNING = {"block": 16384, "block_stats": 8192, "warps": 32, "programs_per_sm": 0}


# 1. reference -------------------------------------------------------------------------------------
def transform_logits(logits: torch.Tensor, logits_scaling: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """fp32 logits after Granite-style scaling and Gemma-2-style soft-capping."""
    z = logits.float()
    if logits_scaling != 1.0:
        z = z / logits_scaling
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z


def cross_entropy_reference(
    logits, target, ignore_index=-100, reduction="mean", label_smoothing=0.0, lse_square_scale=0.0,
    softcap=None, logits_scaling=1.0, num_items_in_batch=None, return_z_loss=False, weight=None,
    return_token_accuracy=False, return_entropy=False,
):
    """The math in plain torch (fp32). Same signature and semantics as :func:`cross_entropy`."""
    z = transform_logits(logits.reshape(-1, logits.shape[-1]), logits_scaling, softcap)
    target = target.reshape(-1)
    valid = target != ignore_index
    safe_target = torch.where(valid, target, torch.zeros_like(target)).long()
    log_p = torch.log_softmax(z, dim=-1)
    lse = torch.logsumexp(z, dim=-1)
    w = None if weight is None else weight.float()
    nll = -log_p.gather(1, safe_target[:, None]).squeeze(1)
    if w is not None:
        nll = w[safe_target] * nll
    if label_smoothing:
        smooth = -(log_p * w).sum(-1) if w is not None else -log_p.sum(-1)
        nll = (1.0 - label_smoothing) * nll + label_smoothing / z.shape[-1] * smooth
    z_loss = lse_square_scale * lse.square()
    zero = torch.zeros((), device=z.device)
    rows = torch.where(valid, nll + z_loss, zero)
    z_rows = torch.where(valid, z_loss, zero)
    denominator = None if w is None else torch.where(valid, w[safe_target], zero).sum()
    loss = _reduce(rows, valid, reduction, num_items_in_batch, denominator)
    extras = [_reduce(z_rows, valid, reduction, num_items_in_batch, denominator).detach()] if return_z_loss else []
    if return_token_accuracy:
        extras.append(_reduce(torch.where(valid, (z.argmax(-1) == safe_target).float(), zero), valid, reduction))
    if return_entropy:
        entropy = -(log_p.exp() * log_p).sum(-1)
        extras.append(_reduce(torch.where(valid, entropy, zero), valid, reduction).detach())
    if reduction == "none":
        loss, extras = loss.view(target.shape), [e.view(target.shape) for e in extras]
    return (loss, *extras) if extras else loss


def _reduce(rows, valid, reduction, num_items_in_batch=None, denominator=None):
    if reduction == "none":
        return rows
    total = rows.sum()
    if reduction == "sum":
        return total
    if num_items_in_batch is not None:
        return total / torch.as_tensor(num_items_in_batch, device=rows.device, dtype=torch.float32)
    if denominator is not None:
        return total / denominator
    return total / valid.sum().clamp(min=1)


# 2. kernels ---------------------------------------------------------------------------------------
@triton.jit
def _transform(x, inv_scaling, softcap, HAS_SOFTCAP: tl.constexpr):
    """Transformed logits z (natural units) from fp32 ``x``, and tanh(z / softcap) for the softcap
    derivative."""
    z = x * inv_scaling
    if HAS_SOFTCAP:
        th = 2.0 * tl.sigmoid(2.0 * z / softcap) - 1.0  # tanh without libdevice (runs in the interpreter)
        return softcap * th, th
    return z, z


@triton.jit
def _cross_entropy_kernel(
    LOGITS, logits_stride, TARGET, GRAD, grad_stride, LOSS, STATS, ZLOSS, ACC, ENT, DLOSS, dloss_stride,
    CLASS_W, CLASS_W_SUM, n_rows, n_cols, ignore_index, label_smoothing, lse_square_scale, inv_scaling, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    ROW_STATS: tl.constexpr, FORWARD: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):
    # a persistent grid when programs < rows (fewer rows in flight per SM). Rows are first + i * step with first
    # int64, so row * stride is 64-bit on the GPU and in the interpreter alike (a row index taken from range()
    # itself would be a Python int there, multiplied in int32)
    first = tl.program_id(0).to(tl.int64)
    step = tl.num_programs(0)
    for i in range(0, tl.cdiv(n_rows - first, step)):
        row = first + i * step
        _cross_entropy_row(
            row, LOGITS, logits_stride, TARGET, GRAD, grad_stride, LOSS, STATS, ZLOSS, ACC, ENT, DLOSS, dloss_stride,
            CLASS_W, CLASS_W_SUM, n_rows, n_cols, ignore_index, label_smoothing, lse_square_scale, inv_scaling,
            softcap, HAS_SOFTCAP, HAS_SMOOTHING, HAS_ZLOSS, HAS_WEIGHT, ROW_STATS, FORWARD, WRITE_GRAD, BLOCK,
        )


@triton.jit
def _cross_entropy_row(
    row, LOGITS, logits_stride, TARGET, GRAD, grad_stride, LOSS, STATS, ZLOSS, ACC, ENT, DLOSS, dloss_stride,
    CLASS_W, CLASS_W_SUM, n_rows, n_cols, ignore_index, label_smoothing, lse_square_scale, inv_scaling, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    ROW_STATS: tl.constexpr, FORWARD: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):
    # FORWARD: logsumexp (kept as the row max m and log_s = log sum exp(z - m), STATS[row] and
    # STATS[n_rows + row]), loss and z-loss of the row; ROW_STATS: accuracy and entropy too.
    # WRITE_GRAD: d(loss)/d(logits) times DLOSS[row] (the reduction scale in the forward, the incoming
    # gradient in a backward). exp2 is the hardware instruction; its argument is formed from z - m, which
    # is exact, so the precision does not depend on the size of the logits.
    LOG2E: tl.constexpr = 1.4426950408889634
    target = tl.load(TARGET + row)
    x_row = LOGITS + row * logits_stride
    g_row = GRAD + row * grad_stride
    cols = tl.arange(0, BLOCK)
    n_chunks = tl.cdiv(n_cols, BLOCK)
    if target == ignore_index:
        if FORWARD:
            tl.store(LOSS + row, 0.0)
            tl.store(STATS + row, 0.0)
            tl.store(STATS + n_rows + row, 0.0)
            tl.store(ZLOSS + row, 0.0)
            if ROW_STATS:
                tl.store(ACC + row, 0.0)
                tl.store(ENT + row, 0.0)
        if WRITE_GRAD:
            for i in range(n_chunks):
                c = i * BLOCK + cols
                tl.store(g_row + c, tl.zeros([BLOCK], dtype=GRAD.dtype.element_ty), mask=c < n_cols)
    else:
        # an out-of-range target (possible only with check_targets=False) poisons the loss with NaN
        in_range = (target >= 0) & (target < n_cols)
        target32 = target.to(tl.int32)
        if HAS_WEIGHT:
            w_t = tl.load(CLASS_W + target, mask=in_range, other=float("nan")).to(tl.float32)
            w_sum = tl.load(CLASS_W_SUM).to(tl.float32)
        else:
            w_t = 1.0
            w_sum = n_cols * 1.0
        if FORWARD:
            # online logsumexp per lane: no reduction inside the loop
            m_lane = tl.zeros([BLOCK], dtype=tl.float32) - float("inf")
            s_lane = tl.zeros([BLOCK], dtype=tl.float32)
            if ROW_STATS:
                i_lane = tl.zeros([BLOCK], dtype=tl.int32)
            if HAS_SMOOTHING:
                # sum_j w_j (z_j - z_0): shifted by the row's first logit so that a large common offset cancels
                z_first, th_first = _transform(tl.load(x_row).to(tl.float32), inv_scaling, softcap, HAS_SOFTCAP)
                acc_lane = tl.zeros([BLOCK], dtype=tl.float32)
            for i in range(n_chunks):
                c = i * BLOCK + cols
                mask = c < n_cols
                x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
                z, th_unused = _transform(x, inv_scaling, softcap, HAS_SOFTCAP)
                z = tl.where(mask, z, float("-inf"))
                # lanes that have only seen padding keep m = -inf and s = 0 (shift by 0, not by -inf)
                m_new = tl.maximum(m_lane, z)
                shift = tl.where(m_new > float("-inf"), m_new, 0.0)
                s_lane = s_lane * tl.exp2((m_lane - shift) * LOG2E) + tl.exp2((z - shift) * LOG2E)
                if ROW_STATS:
                    i_lane = tl.where(z > m_lane, c, i_lane)  # strict: the first maximum of each lane
                m_lane = m_new
                if HAS_SMOOTHING:
                    d = tl.where(mask, z - z_first, 0.0)
                    if HAS_WEIGHT:
                        d = d * tl.load(CLASS_W + c, mask=mask, other=0.0).to(tl.float32)
                    acc_lane += d
            m = tl.max(m_lane, axis=0)
            s = tl.sum(s_lane * tl.exp2((m_lane - m) * LOG2E), axis=0)
            log_s = tl.log(s)
            x_t = tl.load(x_row + target, mask=in_range, other=float("nan")).to(tl.float32)
            z_t, th_t = _transform(x_t, inv_scaling, softcap, HAS_SOFTCAP)
            loss = w_t * ((m - z_t) + log_s)
            if HAS_SMOOTHING:
                # sum_j w_j (lse - z_j) = w_sum * (lse - z_0) - sum_j w_j (z_j - z_0)
                smooth = w_sum * ((m - z_first) + log_s) - tl.sum(acc_lane, axis=0)
                loss = (1.0 - label_smoothing) * loss + label_smoothing / n_cols * smooth
            lse = m + log_s
            z_loss = lse_square_scale * lse * lse
            tl.store(LOSS + row, loss + z_loss)
            tl.store(STATS + row, m)
            tl.store(STATS + n_rows + row, log_s)
            tl.store(ZLOSS + row, z_loss)
            if ROW_STATS:
                argmax = tl.min(tl.where(m_lane == m, i_lane, 2147483647), axis=0)
                tl.store(ACC + row, tl.where(argmax == target32, 1.0, 0.0))
        else:
            m = tl.load(STATS + row)
            log_s = tl.load(STATS + n_rows + row)
            lse = m + log_s
        if WRITE_GRAD or (ROW_STATS and FORWARD):
            if WRITE_GRAD:
                scale = tl.load(DLOSS + row * dloss_stride).to(tl.float32) * inv_scaling
            # d loss / d z_j = p_j * coef - (1 - eps) w_t [j == t] - (eps / V) w_j
            coef = w_t * (1.0 - label_smoothing) + label_smoothing * w_sum / n_cols
            if HAS_ZLOSS:
                coef = coef + 2.0 * lse_square_scale * lse
            ent = tl.zeros([BLOCK], dtype=tl.float32)
            # last chunks first: they are the ones the forward pass read most recently (still in L2)
            for i in range(n_chunks):
                c = (n_chunks - 1 - i) * BLOCK + cols
                mask = c < n_cols
                x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
                z, th = _transform(x, inv_scaling, softcap, HAS_SOFTCAP)
                log_p = (z - m) - log_s
                p = tl.exp2(log_p * LOG2E)
                if ROW_STATS and FORWARD:
                    ent += tl.where(mask, p * log_p, 0.0)
                if WRITE_GRAD:
                    if HAS_WEIGHT or HAS_SMOOTHING or HAS_ZLOSS:
                        g = p * coef
                    else:
                        g = p
                    if HAS_SMOOTHING:
                        if HAS_WEIGHT:
                            g = g - label_smoothing / n_cols * tl.load(CLASS_W + c, mask=mask, other=0.0).to(tl.float32)
                        else:
                            g = g - label_smoothing / n_cols
                    g = g - tl.where(c == target32, w_t * (1.0 - label_smoothing), 0.0)
                    if HAS_SOFTCAP:
                        g = g * (1.0 - th * th)
                    tl.store(g_row + c, (g * scale).to(GRAD.dtype.element_ty), mask=mask)
            if ROW_STATS and FORWARD:
                tl.store(ENT + row, -tl.sum(ent, axis=0))


@triton.jit
def _scale_unless_one_kernel(X, n_elements, SCALE, BLOCK: tl.constexpr):
    # multiplies X by the device scalar SCALE; when it is exactly 1 every access is masked off, so the
    # common loss.backward() costs one tiny launch and no host synchronisation
    s = tl.load(SCALE).to(tl.float32)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < tl.where(s != 1.0, n_elements, 0)
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(X + offs, (x * s).to(X.dtype.element_ty), mask=mask)


# 3. launchers -------------------------------------------------------------------------------------
def ce_launch(logits, target, *, grad=None, dloss=None, stats=None, class_weight=None, class_weight_sum=None,
              row_stats=False, ignore_index=-100, label_smoothing=0.0, lse_square_scale=0.0, logits_scaling=1.0,
              softcap=None):
    """Run the row kernel on 2-D ``logits`` (unit column stride) and 1-D ``target``.

    Without ``stats``: computes and returns (loss_rows, stats, z_loss_rows, accuracy_rows, entropy_rows)
    (stats = [2, rows] fp32: row max and log-sum-exp relative to it; accuracy/entropy None unless
    ``row_stats``); with ``grad`` (may be ``logits`` itself) also writes the gradient times ``dloss`` (a
    device scalar or per-row vector). With ``stats`` given (a backward): only writes the gradient.
    ``class_weight``: fp32 [V] per-class weights or None; ``class_weight_sum``: its sum as a device scalar
    (computed here when not given; a caller launching chunk after chunk passes it once).
    """
    n_rows, n_cols = logits.shape
    forward = stats is None
    f32 = dict(dtype=torch.float32, device=logits.device)
    acc = ent = None
    if forward:
        loss, stats, z_loss = torch.empty(n_rows, **f32), torch.empty((2, n_rows), **f32), torch.empty(n_rows, **f32)
        if row_stats:
            acc, ent = torch.empty(n_rows, **f32), torch.empty(n_rows, **f32)
    else:
        loss = z_loss = stats  # unused by the kernel
        row_stats = False
    write_grad = grad is not None
    if not write_grad:
        grad, dloss = logits, stats  # unused
    has_weight = class_weight is not None
    if not has_weight:
        weight_sum = stats  # unused
    else:
        weight_sum = class_weight.sum(dtype=torch.float32) if class_weight_sum is None else class_weight_sum
    config = _row_config(n_cols, _forward_pressure(row_stats, softcap, label_smoothing) if forward else 0)
    if n_rows:
        _cross_entropy_kernel[(_num_programs(logits.device, n_rows),)](
            logits, logits.stride(0), target, grad, grad.stride(0), loss, stats, z_loss,
            acc if acc is not None else stats, ent if ent is not None else stats,
            dloss, dloss.stride(0) if dloss.dim() == 1 else 0, class_weight if has_weight else stats, weight_sum,
            n_rows, n_cols, ignore_index, float(label_smoothing), float(lse_square_scale), 1.0 / logits_scaling,
            float(softcap or 1.0),
            HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=label_smoothing > 0, HAS_ZLOSS=lse_square_scale > 0,
            HAS_WEIGHT=has_weight, ROW_STATS=row_stats, FORWARD=forward, WRITE_GRAD=write_grad, **config,
        )
    return loss, stats, z_loss, acc, ent


def _forward_pressure(row_stats: bool, softcap, label_smoothing: float) -> int:
    """The forward's per-lane state beyond the logsumexp (see TUNING)."""
    return 2 * bool(row_stats) + (softcap is not None) + (label_smoothing > 0)


def _row_config(n_cols: int, pressure: int) -> dict:
    """The row kernel's BLOCK and num_warps for rows of ``n_cols`` at a forward's register ``pressure``."""
    block = min(TUNING["block_stats"] if pressure >= 2 else TUNING["block"], triton.next_power_of_2(n_cols))
    return dict(BLOCK=block, num_warps=min(TUNING["warps"], max(4, block // 128)))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _num_programs(device: torch.device, n_rows: int) -> int:
    if device.type != "cuda":
        return min(n_rows, 4)  # the interpreter: still exercises the row loop
    if not TUNING["programs_per_sm"]:
        return n_rows
    return min(n_rows, TUNING["programs_per_sm"] * _sm_count(device))


def scale_unless_one_(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x *= scale in place (x contiguous, scale a device scalar), skipping all memory traffic if scale == 1."""
    if torch.compiler.is_compiling():
        return x * scale
    block = 4096
    if x.numel():
        _scale_unless_one_kernel[(triton.cdiv(x.numel(), block),)](x, x.numel(), scale, BLOCK=block, num_warps=8)
    return x


def reduction_scale(valid_count: torch.Tensor, reduction: str, num_items_in_batch, device,
                    weight_total: torch.Tensor | None = None) -> torch.Tensor:
    """The device scalar every row's loss is multiplied by (1 for sum; 1/count, 1/sum of the target
    weights, or 1/num_items for mean)."""
    if reduction == "sum":
        return torch.ones((), dtype=torch.float32, device=device)
    if num_items_in_batch is not None:
        return 1.0 / torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=device)
    if weight_total is not None:
        return 1.0 / weight_total.to(torch.float32)
    return 1.0 / valid_count.clamp(min=1).to(torch.float32)


def target_weight_total(class_weight: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """sum of w[t] over the non-ignored targets (torch's "mean" divisor with per-class weights)."""
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    return torch.where(valid, class_weight.index_select(0, safe.clamp(0, class_weight.numel() - 1)), 0.0).sum()


def stats_mean(rows: torch.Tensor, valid_count: torch.Tensor, reduction: str) -> torch.Tensor:
    """Accuracy / entropy rows reduced like the loss (mean over the non-ignored rows)."""
    if reduction == "none":
        return rows
    total = rows.sum()
    return total if reduction == "sum" else total / valid_count.clamp(min=1).to(torch.float32)


# 4. custom ops and autograd -----------------------------------------------------------------------
def _forward_fake(logits, target, scale, class_weight, ignore_index, label_smoothing, lse_square_scale,
                  logits_scaling, softcap, compute_grad, row_stats):
    n = logits.shape[0]
    rows = logits.new_empty(n, dtype=torch.float32)
    grad = logits.new_empty(logits.shape) if compute_grad else logits.new_empty(0)
    extra = rows.new_empty(n) if row_stats else rows.new_empty(0)
    return rows, rows.new_empty((2, n)), rows.new_empty(n), extra, extra.new_empty(extra.shape), grad


@custom_op("cross_entropy_forward", _forward_fake)
def _forward_op(
    logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, class_weight: torch.Tensor | None,
    ignore_index: int, label_smoothing: float, lse_square_scale: float, logits_scaling: float,
    softcap: float | None, compute_grad: bool, row_stats: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device) if compute_grad else None
    loss, stats, z_loss, acc, ent = ce_launch(
        logits, target, grad=grad, dloss=scale, class_weight=class_weight, row_stats=row_stats,
        ignore_index=ignore_index, label_smoothing=label_smoothing, lse_square_scale=lse_square_scale,
        logits_scaling=logits_scaling, softcap=softcap,
    )
    def empty():  # custom ops return no None, and no two outputs may alias
        return logits.new_empty(0, dtype=torch.float32)

    return (loss, stats, z_loss, acc if acc is not None else empty(), ent if ent is not None else empty(),
            grad if grad is not None else logits.new_empty(0))


def _backward_fake(dloss, logits, target, stats, class_weight, ignore_index, label_smoothing, lse_square_scale,
                   logits_scaling, softcap):
    return logits.new_empty(logits.shape)


@custom_op("cross_entropy_backward", _backward_fake)
def _backward_op(
    dloss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, stats: torch.Tensor,
    class_weight: torch.Tensor | None, ignore_index: int, label_smoothing: float, lse_square_scale: float,
    logits_scaling: float, softcap: float | None,
) -> torch.Tensor:
    """The gradient for an incoming gradient ``dloss`` (per row [N], or a scalar for every row)."""
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    ce_launch(logits, target, grad=grad, dloss=dloss.float(), stats=stats, class_weight=class_weight,
              ignore_index=ignore_index, label_smoothing=label_smoothing, lse_square_scale=lse_square_scale,
              logits_scaling=logits_scaling, softcap=softcap)
    return grad


def gradient_in_backward(dtype: torch.dtype) -> bool:
    """fp16: a gradient computed in the forward (already divided by N) underflows before the loss scale
    arrives, so it is computed in the backward, times the incoming gradient."""
    return dtype == torch.float16


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, scale, class_weight, options, reduction, inplace, row_stats):
        # logits: 2-D with unit column stride; target 1-D; scale: device scalar (mean/sum) or None (none).
        # Returns (loss, z_loss, accuracy rows, entropy rows): loss/z_loss per row for "none", else their
        # sums times scale.
        ctx.options, ctx.reduction, ctx.inplace, ctx.used = options, reduction, inplace, False
        ctx.deferred = reduction == "none" or gradient_in_backward(logits.dtype)
        if ctx.deferred:
            loss, stats, z_loss, acc, ent, _ = _forward_op(logits, target, _one(logits.device), class_weight,
                                                           **options, compute_grad=False, row_stats=row_stats)
            ctx.save_for_backward(logits, target, stats, class_weight, scale)
        else:
            if inplace:  # eager only (compiled calls never take this path)
                loss, _, z_loss, acc, ent = ce_launch(logits, target, grad=logits, dloss=scale,
                                                      class_weight=class_weight, row_stats=row_stats, **options)
                grad = logits
            else:
                loss, _, z_loss, acc, ent, grad = _forward_op(logits, target, scale, class_weight, **options,
                                                              compute_grad=True, row_stats=row_stats)
            ctx.save_for_backward(grad)
        acc = acc if acc is not None else loss.new_empty(0)
        ent = ent if ent is not None else loss.new_empty(0)
        if reduction != "none":
            loss, z_loss = loss.sum() * scale, z_loss.sum() * scale
        ctx.mark_non_differentiable(z_loss, acc, ent)
        return loss, z_loss, acc, ent

    @staticmethod
    def backward(ctx, dloss, _dz, _dacc, _dent):
        nones = (None,) * 7
        if ctx.deferred:
            logits, target, stats, class_weight, scale = ctx.saved_tensors
            # "none": the per-row incoming gradients; mean/sum (fp16): one scalar for every row
            d = dloss.float().contiguous() if ctx.reduction == "none" else dloss.float() * scale
            if ctx.inplace:
                ce_launch(logits, target, grad=logits, dloss=d, stats=stats, class_weight=class_weight,
                          **ctx.options)
                return (logits, *nones)
            return (_backward_op(d, logits, target, stats, class_weight, **ctx.options), *nones)
        if ctx.used:
            raise RuntimeError(
                "cross_entropy: backward ran twice through a mean/sum loss; its gradient is computed in the "
                "forward and consumed by the first backward. Use reduction='none' with retain_graph."
            )
        ctx.used = True
        (grad,) = ctx.saved_tensors
        return (scale_unless_one_(grad, dloss.float()), *nones)


def _one(device):
    return torch.ones((), dtype=torch.float32, device=device)
# 5. public function -------------------------------------------------------------------------------
def check_loss_options(op, reduction, label_smoothing, lse_square_scale, softcap, logits_scaling, num_items_in_batch):
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if num_items_in_batch is not None and reduction != "mean":
        raise ValueError(
            f"{op}: num_items_in_batch replaces the divisor of reduction='mean' (sum / num_items_in_batch, as "
            f"transformers' ForCausalLMLoss); it cannot be combined with reduction={reduction!r}"
        )
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1), got {label_smoothing}")
    if lse_square_scale < 0:
        raise ValueError(f"{op}: lse_square_scale (z-loss weight) must be >= 0, got {lse_square_scale}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{op}: softcap must be None or > 0, got {softcap}")
    if not logits_scaling > 0:
        raise ValueError(f"{op}: logits_scaling must be > 0, got {logits_scaling}")


def check_class_weight(op, name, class_weight, n_classes, device, lse_square_scale):
    """Validates the per-class weights; returns them as a contiguous fp32 tensor (or None)."""
    if class_weight is None:
        return None
    if not isinstance(class_weight, torch.Tensor) or not class_weight.is_floating_point():
        got = class_weight.dtype if isinstance(class_weight, torch.Tensor) else type(class_weight).__name__
        raise ValueError(f"{op}: {name} must be a floating-point tensor of one weight per class, got {got}")
    if class_weight.shape != (n_classes,):
        raise ValueError(f"{op}: {name} must have shape ({n_classes},) (one weight per class), got "
                         f"{tuple(class_weight.shape)}")
    if class_weight.requires_grad:
        raise ValueError(f"{op}: gradients w.r.t. {name} are not supported; pass it detached")
    check_same_device(op, rows=torch.empty(0, device=device), **{name: class_weight})
    if lse_square_scale:
        raise ValueError(f"{op}: {name} together with the z-loss (lse_square_scale > 0) is not supported; "
                         "use one of the two")
    return class_weight.detach().float().contiguous()


def loss_options(ignore_index, label_smoothing, lse_square_scale, logits_scaling, softcap) -> dict:
    """The keyword arguments of ce_launch, normalised to Python numbers."""
    return {"ignore_index": int(ignore_index), "label_smoothing": float(label_smoothing),
            "lse_square_scale": float(lse_square_scale), "logits_scaling": float(logits_scaling),
            "softcap": None if softcap is None else float(softcap)}


def _check_targets(op, target, n_rows, n_classes, ignore_index, device, check_range=True):
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int64, torch.int32):
        got = target.dtype if isinstance(target, torch.Tensor) else type(target).__name__
        raise ValueError(f"{op}: target must be an int64 or int32 tensor, got {got}")
    if target.numel() != n_rows:
        raise ValueError(f"{op}: target has {target.numel()} elements (shape {tuple(target.shape)}); expected "
                         f"one per row, {n_rows}")
    if n_rows == 0:
        raise ValueError(f"{op}: empty batch (0 rows): there is no loss to compute")
    check_same_device(op, rows=torch.empty(0, device=device), target=target)
    if check_range and not torch.compiler.is_compiling():  # one host sync
        bad = (target != ignore_index) & ((target < 0) | (target >= n_classes))
        if bool(bad.any()):
            value = int(target[bad][0])
            raise ValueError(
                f"{op}: target value {value} is out of range: targets must be in [0, {n_classes}) or equal "
                f"ignore_index ({ignore_index})"
            )


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    logits_scaling: float = 1.0,
    num_items_in_batch=None,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    return_entropy: bool = False,
    inplace_backward: bool = False,
    check_targets: bool = True,
):
    """Cross-entropy of ``logits [..., V]`` against integer ``target [...]`` (see the module docstring).

    ``weight``: optional per-class weights ``[V]`` with ``torch.nn.functional.cross_entropy``'s semantics
    (mean divides by the sum of the target weights). Returns the loss, or a tuple ``(loss, [z_loss],
    [token_accuracy], [entropy])`` with the requested extras in that order. ``check_targets`` raises a
    ValueError for targets outside [0, V) other than ignore_index; it costs one host synchronisation. With
    ``check_targets=False`` such a row makes the loss NaN instead.
    """
    op = "cross_entropy"
    check_float_tensor(op, "logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"{op}: logits must have a non-empty class dimension, got shape {tuple(logits.shape)}")
    if logits.shape[-1] > MAX_VOCAB:
        raise ValueError(f"{op}: {logits.shape[-1]} classes exceed the supported maximum {MAX_VOCAB}")
    n_classes = logits.shape[-1]
    n_rows = logits.numel() // n_classes
    _check_targets(op, target, n_rows, n_classes, ignore_index, logits.device, check_targets)
    check_loss_options(op, reduction, label_smoothing, lse_square_scale, softcap, logits_scaling, num_items_in_batch)
    class_weight = check_class_weight(op, "weight", weight, n_classes, logits.device, lse_square_scale)
    if inplace_backward and not logits.is_contiguous():
        raise ValueError(f"{op}: inplace_backward=True writes the gradient into logits, which must be contiguous")
    options = loss_options(ignore_index, label_smoothing, lse_square_scale, logits_scaling, softcap)
    if not use_triton(logits.device):
        return cross_entropy_reference(logits, target, reduction=reduction, num_items_in_batch=num_items_in_batch,
                                       return_z_loss=return_z_loss, weight=class_weight,
                                       return_token_accuracy=return_token_accuracy, return_entropy=return_entropy,
                                       **options)
    training = torch.is_grad_enabled() and logits.requires_grad
    inplace = training and bool(inplace_backward) and not torch.compiler.is_compiling()
    if inplace:
        # before any view of the logits exists (bumping the version of a viewed tensor turns the view's
        # backward into a copying AsStrided): an op that saved the logits earlier now fails loudly
        claim(logits)
    logits2 = logits.reshape(-1, n_classes)
    if logits2.stride(-1) != 1:
        logits2 = logits2.contiguous()
    target1 = target.reshape(-1)
    valid_count = (target1 != ignore_index).sum()
    weight_total = None if class_weight is None else target_weight_total(class_weight, target1, ignore_index)
    scale = None if reduction == "none" else reduction_scale(valid_count, reduction, num_items_in_batch,
                                                             logits.device, weight_total)
    row_stats = bool(return_token_accuracy or return_entropy)
    if training:
        loss, z_loss, acc, ent = _CrossEntropyFunction.apply(logits2, target1, scale, class_weight, options,
                                                             reduction, inplace, row_stats)
    else:
        rows, _, z_rows, acc, ent, _ = _forward_op(logits2, target1, _one(logits.device), class_weight, **options,
                                                   compute_grad=False, row_stats=row_stats)
        loss, z_loss = (rows, z_rows) if reduction == "none" else (rows.sum() * scale, z_rows.sum() * scale)
    extras = [z_loss] if return_z_loss else []
    if return_token_accuracy:
        extras.append(stats_mean(acc, valid_count, reduction))
    if return_entropy:
        extras.append(stats_mean(ent, valid_count, reduction))
    if reduction == "none":
        loss, extras = loss.view(target.shape), [e.view(target.shape) for e in extras]
    return (loss, *extras) if extras else loss
