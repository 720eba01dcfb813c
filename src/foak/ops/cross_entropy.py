"""Cross-entropy over a vocabulary, forward and backward, with the options LLM fine-tuning uses.

Per row ``i`` with target ``t`` (rows whose target is ``ignore_index`` contribute nothing):
    z      = softcap * tanh((logits / logits_scaling) / softcap)     (softcap=None: logits / logits_scaling)
    lse    = logsumexp(z)
    loss_i = (1 - eps) * (lse - z_t) + eps * (lse - mean_j z_j)      (eps = label_smoothing)
             + lse_square_scale * lse**2                              (z-loss)
Reductions: "none" (per row, 0 where ignored), "sum", "mean" (sum / number of non-ignored rows; 0 when
every row is ignored, where torch returns NaN). ``num_items_in_batch`` (with "mean") divides the sum by
that count instead, exactly as transformers' ``ForCausalLMLoss`` does, so gradient accumulation over
micro-batches equals one large batch. Math is fp32 inside for any input dtype.

For "mean"/"sum" the kernel computes the gradient during the forward (one read of the logits, a second
read of each row while it is still in L2, one write of the gradient) and the backward only rescales it
when the incoming gradient is not 1 (checked on the device, no host sync). For "none" the backward makes
one pass over the logits with the per-row incoming gradients. The gradient lives in a new buffer, or in
the logits' own memory with ``inplace_backward=True`` (the caller's logits are then overwritten).
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
# per row, blocks of 16384 with 32 warps and per-lane logsumexp were fastest, 2.46 ms fwd+bwd).
TUNING = {"block": 16384, "warps": 32, "programs_per_sm": 0, "lane_lse": True}


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
    softcap=None, logits_scaling=1.0, num_items_in_batch=None, return_z_loss=False,
):
    """The math in plain torch (fp32). Same signature and semantics as :func:`cross_entropy`."""
    z = transform_logits(logits.reshape(-1, logits.shape[-1]), logits_scaling, softcap)
    target = target.reshape(-1)
    valid = target != ignore_index
    safe_target = torch.where(valid, target, torch.zeros_like(target)).long()
    lse = torch.logsumexp(z, dim=-1)
    nll = lse - z.gather(1, safe_target[:, None]).squeeze(1)
    if label_smoothing:
        nll = (1.0 - label_smoothing) * nll + label_smoothing * (lse - z.mean(dim=-1))
    z_loss = lse_square_scale * lse.square()
    zero = torch.zeros((), device=z.device)
    rows = torch.where(valid, nll + z_loss, zero)
    z_rows = torch.where(valid, z_loss, zero)
    loss, z_loss = _reduce(rows, valid, reduction, num_items_in_batch), _reduce(z_rows, valid, reduction, num_items_in_batch)
    if reduction == "none":
        loss, z_loss = loss.view(target.shape), z_loss.view(target.shape)
    return (loss, z_loss.detach()) if return_z_loss else loss


def _reduce(rows, valid, reduction, num_items_in_batch):
    if reduction == "none":
        return rows
    total = rows.sum()
    if reduction == "sum":
        return total
    if num_items_in_batch is not None:
        return total / torch.as_tensor(num_items_in_batch, device=rows.device, dtype=torch.float32)
    return total / valid.sum().clamp(min=1)


# 2. kernels ---------------------------------------------------------------------------------------
@triton.jit
def _transform2(x, scale2, softcap, HAS_SOFTCAP: tl.constexpr):
    """Transformed logits in base 2 (z * log2(e)) from fp32 ``x``; scale2 = log2(e) / logits_scaling.
    Also returns tanh(z / softcap) for the softcap derivative."""
    if HAS_SOFTCAP:
        z = x * (scale2 * 0.6931471805599453)
        th = 2.0 * tl.sigmoid(2.0 * z / softcap) - 1.0  # tanh without libdevice (runs in the interpreter)
        return softcap * th * 1.4426950408889634, th
    return x * scale2, x


@triton.jit
def _cross_entropy_kernel(
    LOGITS, logits_stride, TARGET, GRAD, grad_stride, LOSS, LSE, ZLOSS, DLOSS, dloss_stride,
    n_rows, n_cols, ignore_index, label_smoothing, lse_square_scale, inv_scaling, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr,
    FORWARD: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr, LANE_LSE: tl.constexpr,
):
    # a persistent grid when programs < rows (fewer rows in flight per SM)
    first = tl.program_id(0).to(tl.int64)
    for row in range(first, n_rows, tl.num_programs(0)):
        _cross_entropy_row(
            row, LOGITS, logits_stride, TARGET, GRAD, grad_stride, LOSS, LSE, ZLOSS, DLOSS, dloss_stride,
            n_cols, ignore_index, label_smoothing, lse_square_scale, inv_scaling, softcap,
            HAS_SOFTCAP, HAS_SMOOTHING, HAS_ZLOSS, FORWARD, WRITE_GRAD, BLOCK, LANE_LSE,
        )


@triton.jit
def _cross_entropy_row(
    row, LOGITS, logits_stride, TARGET, GRAD, grad_stride, LOSS, LSE, ZLOSS, DLOSS, dloss_stride,
    n_cols, ignore_index, label_smoothing, lse_square_scale, inv_scaling, softcap,
    HAS_SOFTCAP: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_ZLOSS: tl.constexpr,
    FORWARD: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr, LANE_LSE: tl.constexpr,
):
    # FORWARD: logsumexp, loss and z-loss of the row. WRITE_GRAD: d(loss)/d(logits) times DLOSS[row]
    # (the reduction scale in the forward, the incoming per-row gradient in a reduction="none" backward).
    # Exponentials run in base 2 (exp2 is the hardware instruction): z2 = z * log2(e).
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
    scale2 = inv_scaling * LOG2E
    target = tl.load(TARGET + row)
    x_row = LOGITS + row * logits_stride
    g_row = GRAD + row * grad_stride
    cols = tl.arange(0, BLOCK)
    n_chunks = tl.cdiv(n_cols, BLOCK)
    if target == ignore_index:
        if FORWARD:
            tl.store(LOSS + row, 0.0)
            tl.store(LSE + row, 0.0)
            tl.store(ZLOSS + row, 0.0)
        if WRITE_GRAD:
            for i in range(n_chunks):
                c = i * BLOCK + cols
                tl.store(g_row + c, tl.zeros([BLOCK], dtype=GRAD.dtype.element_ty), mask=c < n_cols)
    else:
        if FORWARD:
            sum_z2 = tl.zeros([BLOCK], dtype=tl.float32)
            if LANE_LSE:
                # online logsumexp per lane: no reduction inside the loop, two exp2 per element
                m_lane = sum_z2 - float("inf")
                s_lane = tl.zeros([BLOCK], dtype=tl.float32)
            else:
                # online logsumexp with one max per chunk: one exp2 per element, two reductions per chunk
                m = tl.max(sum_z2, axis=0) - float("inf")  # fp32 scalar tensors (loop-carried types match)
                s = tl.sum(sum_z2, axis=0)
            for i in range(n_chunks):
                c = i * BLOCK + cols
                mask = c < n_cols
                x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
                z2, _ = _transform2(x, scale2, softcap, HAS_SOFTCAP)
                z2 = tl.where(mask, z2, float("-inf"))
                if LANE_LSE:
                    # lanes that have only seen padding keep m = -inf and s = 0 (shift by 0, not by -inf)
                    m_new = tl.maximum(m_lane, z2)
                    shift = tl.where(m_new > float("-inf"), m_new, 0.0)
                    s_lane = s_lane * tl.exp2(m_lane - shift) + tl.exp2(z2 - shift)
                    m_lane = m_new
                else:
                    m_new = tl.maximum(m, tl.max(z2, axis=0))
                    s = s * tl.exp2(m - m_new) + tl.sum(tl.exp2(z2 - m_new), axis=0)
                    m = m_new
                if HAS_SMOOTHING:
                    sum_z2 += tl.where(mask, z2, 0.0)
            if LANE_LSE:
                m = tl.max(m_lane, axis=0)
                s = tl.sum(s_lane * tl.exp2(m_lane - m), axis=0)
            lse2 = m + tl.log2(s)
            lse = lse2 * LN2
            # an out-of-range target (possible only with check_targets=False) poisons the loss with NaN
            in_range = (target >= 0) & (target < n_cols)
            x_t = tl.load(x_row + target, mask=in_range, other=float("nan")).to(tl.float32)
            z2_t, _ = _transform2(x_t, scale2, softcap, HAS_SOFTCAP)
            loss = lse - z2_t * LN2
            if HAS_SMOOTHING:
                mean_z = tl.sum(sum_z2, axis=0) * LN2 / n_cols
                loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - mean_z)
            z_loss = lse_square_scale * lse * lse
            tl.store(LOSS + row, loss + z_loss)
            tl.store(LSE + row, lse)
            tl.store(ZLOSS + row, z_loss)
        else:
            lse = tl.load(LSE + row)
            lse2 = lse * LOG2E
        if WRITE_GRAD:
            scale = tl.load(DLOSS + row * dloss_stride).to(tl.float32) * inv_scaling
            target32 = target.to(tl.int32)
            # last chunks first: they are the ones the forward pass read most recently (still in L2)
            for i in range(n_chunks):
                c = (n_chunks - 1 - i) * BLOCK + cols
                mask = c < n_cols
                x = tl.load(x_row + c, mask=mask, other=0.0).to(tl.float32)
                z2, th = _transform2(x, scale2, softcap, HAS_SOFTCAP)
                g = tl.exp2(z2 - lse2)
                if HAS_ZLOSS:
                    g = g * (1.0 + 2.0 * lse_square_scale * lse)
                if HAS_SMOOTHING:
                    g = g - label_smoothing / n_cols
                g = g - tl.where(c == target32, 1.0 - label_smoothing, 0.0)
                if HAS_SOFTCAP:
                    g = g * (1.0 - th * th)
                tl.store(g_row + c, (g * scale).to(GRAD.dtype.element_ty), mask=mask)


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
def ce_launch(logits, target, *, grad=None, dloss=None, lse=None, ignore_index=-100, label_smoothing=0.0,
              lse_square_scale=0.0, logits_scaling=1.0, softcap=None):
    """Run the row kernel on 2-D ``logits`` (unit column stride) and 1-D ``target``.

    Without ``lse``: computes and returns (loss_rows, lse, z_loss_rows); with ``grad`` (may be ``logits``
    itself) also writes the gradient times ``dloss`` (a device scalar or per-row vector). With ``lse``
    given (reduction="none" backward): only writes the gradient.
    """
    n_rows, n_cols = logits.shape
    forward = lse is None
    f32 = dict(dtype=torch.float32, device=logits.device)
    if forward:
        loss, lse, z_loss = torch.empty(n_rows, **f32), torch.empty(n_rows, **f32), torch.empty(n_rows, **f32)
    else:
        loss = z_loss = lse  # unused by the kernel
    write_grad = grad is not None
    if not write_grad:
        grad, dloss = logits, lse  # unused
    block = min(TUNING["block"], triton.next_power_of_2(n_cols))
    if n_rows:
        _cross_entropy_kernel[(_num_programs(logits.device, n_rows),)](
            logits, logits.stride(0), target, grad, grad.stride(0), loss, lse, z_loss,
            dloss, dloss.stride(0) if dloss.dim() else 0,
            n_rows, n_cols, ignore_index, float(label_smoothing), float(lse_square_scale), 1.0 / logits_scaling,
            float(softcap or 1.0),
            HAS_SOFTCAP=softcap is not None, HAS_SMOOTHING=label_smoothing > 0, HAS_ZLOSS=lse_square_scale > 0,
            FORWARD=forward, WRITE_GRAD=write_grad, BLOCK=block, LANE_LSE=TUNING["lane_lse"],
            num_warps=min(TUNING["warps"], max(4, block // 128)),
        )
    return loss, lse, z_loss


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


def reduction_scale(valid_count: torch.Tensor, reduction: str, num_items_in_batch, device) -> torch.Tensor:
    """The device scalar every row's loss is multiplied by (1 for sum; 1/count or 1/num_items for mean)."""
    if reduction == "sum":
        return torch.ones((), dtype=torch.float32, device=device)
    if num_items_in_batch is not None:
        return 1.0 / torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=device)
    return 1.0 / valid_count.clamp(min=1).to(torch.float32)


# 4. custom ops and autograd -----------------------------------------------------------------------
def _forward_fake(logits, target, scale, ignore_index, label_smoothing, lse_square_scale, logits_scaling,
                  softcap, compute_grad):
    n = logits.shape[0]
    rows = logits.new_empty(n, dtype=torch.float32)
    grad = logits.new_empty(logits.shape) if compute_grad else logits.new_empty(0)
    return rows, rows.new_empty(n), rows.new_empty(n), grad


@custom_op("cross_entropy_forward", _forward_fake)
def _forward_op(
    logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, ignore_index: int, label_smoothing: float,
    lse_square_scale: float, logits_scaling: float, softcap: float | None, compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device) if compute_grad else None
    loss, lse, z_loss = ce_launch(
        logits, target, grad=grad, dloss=scale, ignore_index=ignore_index, label_smoothing=label_smoothing,
        lse_square_scale=lse_square_scale, logits_scaling=logits_scaling, softcap=softcap,
    )
    return loss, lse, z_loss, (grad if grad is not None else logits.new_empty(0))


def _backward_fake(dloss, logits, target, lse, ignore_index, label_smoothing, lse_square_scale, logits_scaling,
                   softcap):
    return logits.new_empty(logits.shape)


@custom_op("cross_entropy_backward", _backward_fake)
def _backward_op(
    dloss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, ignore_index: int,
    label_smoothing: float, lse_square_scale: float, logits_scaling: float, softcap: float | None,
) -> torch.Tensor:
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    ce_launch(logits, target, grad=grad, dloss=dloss.float(), lse=lse, ignore_index=ignore_index,
              label_smoothing=label_smoothing, lse_square_scale=lse_square_scale,
              logits_scaling=logits_scaling, softcap=softcap)
    return grad


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, scale, options, reduction, inplace):
        # logits: 2-D with unit column stride; target 1-D; scale: device scalar (mean/sum) or None (none)
        ctx.options, ctx.reduction, ctx.inplace, ctx.used = options, reduction, inplace, False
        if reduction == "none":
            loss, lse, z_loss, _ = _forward_op(logits, target, _one(logits.device), **options, compute_grad=False)
            ctx.save_for_backward(logits, target, lse)
            ctx.mark_non_differentiable(z_loss)
            return loss, z_loss
        if inplace:  # eager only (compiled calls never take this path)
            loss, _, z_loss = ce_launch(logits, target, grad=logits, dloss=scale, **options)
            grad = logits
        else:
            loss, _, z_loss, grad = _forward_op(logits, target, scale, **options, compute_grad=True)
        ctx.save_for_backward(grad, scale)
        total, z_total = loss.sum() * scale, z_loss.sum() * scale
        ctx.mark_non_differentiable(z_total)
        return total, z_total

    @staticmethod
    def backward(ctx, dloss, _dz):
        if ctx.reduction == "none":
            logits, target, lse = ctx.saved_tensors
            if ctx.inplace:
                ce_launch(logits, target, grad=logits, dloss=dloss.float().contiguous(), lse=lse, **ctx.options)
                grad = logits
            else:
                grad = _backward_op(dloss.contiguous(), logits, target, lse, **ctx.options)
            return grad, None, None, None, None, None
        if ctx.used:
            raise RuntimeError(
                "cross_entropy: backward ran twice through a mean/sum loss; its gradient is computed in the "
                "forward and consumed by the first backward. Use reduction='none' with retain_graph."
            )
        ctx.used = True
        grad, _ = ctx.saved_tensors
        return scale_unless_one_(grad, dloss.float()), None, None, None, None, None


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
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    logits_scaling: float = 1.0,
    num_items_in_batch=None,
    return_z_loss: bool = False,
    inplace_backward: bool = False,
    check_targets: bool = True,
):
    """Cross-entropy of ``logits [..., V]`` against integer ``target [...]`` (see the module docstring).

    ``check_targets`` raises a ValueError for targets outside [0, V) other than ignore_index; it costs one
    host synchronisation. With ``check_targets=False`` such a row makes the loss NaN instead.
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
    if inplace_backward and not logits.is_contiguous():
        raise ValueError(f"{op}: inplace_backward=True writes the gradient into logits, which must be contiguous")
    options = loss_options(ignore_index, label_smoothing, lse_square_scale, logits_scaling, softcap)
    if not use_triton(logits.device):
        return cross_entropy_reference(logits, target, reduction=reduction, num_items_in_batch=num_items_in_batch,
                                       return_z_loss=return_z_loss, **options)
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
    valid = target1 != ignore_index
    scale = None if reduction == "none" else reduction_scale(valid.sum(), reduction, num_items_in_batch, logits.device)
    if training:
        loss, z_loss = _CrossEntropyFunction.apply(logits2, target1, scale, options, reduction, inplace)
    else:
        rows, _, z_rows, _ = _forward_op(logits2, target1, _one(logits.device), **options, compute_grad=False)
        loss, z_loss = (rows, z_rows) if reduction == "none" else (rows.sum() * scale, z_rows.sum() * scale)
    if reduction == "none":
        loss, z_loss = loss.view(target.shape), z_loss.view(target.shape)
    return (loss, z_loss) if return_z_loss else loss
