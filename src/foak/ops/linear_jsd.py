"""Distillation loss between two LM heads (student and teacher) without materialising their [N, V] logits.

``linear_jsd(student_hidden, student_weight, teacher_hidden, teacher_weight, beta=..., ...)`` computes, per
token, a divergence between the student's and the teacher's next-token distributions

    z = softcap(scale * (hidden @ weight.T + bias)) / temperature      (each model with its own scale,
    p = softmax(z)                                                      softcap and bias)

    beta == 0:      KL(p_t || p_s)                                      forward KL
    beta == 1:      KL(p_s || p_t)                                      reverse KL
    0 < beta < 1:   beta * KL(p_t || m) + (1 - beta) * KL(p_s || m)    generalized JSD,
                    with m = (1 - beta) * p_s + beta * p_t

where ``softcap(x) = cap * tanh(x / cap)`` (when a cap is given). This is the definition TRL's distillation
trainer uses (its ``beta``: 0 forward KL, 1 reverse KL). Tokens whose ``mask`` is 0 are skipped (no GEMM
work); the reduction is ``sum / n_valid`` ("mean", or ``sum / num_items_in_batch`` when given), "sum" or
"none" (per token, 0 where masked). ``return_entropy`` adds the student's entropy (no gradient), reduced the
same way (mean over the valid tokens). Gradients flow to the student's hidden states, weight and bias only;
the teacher is a constant.

Tokens are processed in chunks: per chunk, one fp32 ``[rows, V]`` logits tile per model (and, when the GEMMs run
in bf16/fp16, one gradient tile in that dtype), sized by ``chunk_bytes``. A Triton row kernel turns the two tiles
into the per-token divergence and entropy and, in the same launch, the student tile into d loss / d logits;
two GEMMs fold that into the gradients of the student's hidden states and weight, so the backward of a
"mean"/"sum" loss only scales them by the incoming gradient (fp16 and reduction="none": the gradient is
computed in the backward, recomputing both heads' logits).

Precision: the logits are fp32 (the GEMM accumulates in fp32 and writes fp32 on CUDA; on CPU the operands are
upcast). Under torch autocast the GEMMs run in the autocast dtype, as ``nn.Linear`` would, and an fp32 master
weight gets an fp32 gradient; without autocast each hidden state must have its weight's dtype. The student
weight's gradient accumulates across chunks in fp32 unless ``accum_dtype=None``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from foak.backend import use_triton
from foak.ops._checks import check_float_tensor, check_same_device, check_same_dtype
from foak.ops.cross_entropy import gradient_in_backward, reduction_scale, scale_unless_one_
from foak.ops.linear_cross_entropy import _weight_gradient_gemm

FORWARD_KL, REVERSE_KL, JSD = 0, 1, 2
REDUCTIONS = ("mean", "sum", "none")


def divergence_mode(beta: float) -> int:
    return FORWARD_KL if beta == 0 else REVERSE_KL if beta == 1 else JSD


# 1. reference -------------------------------------------------------------------------------------
def transform_logits(logits: torch.Tensor, scale: float, softcap: float | None, temperature: float):
    z = logits * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def divergence_rows_reference(zs: torch.Tensor, zt: torch.Tensor, beta: float):
    """Per-row divergence and student entropy from the transformed logits (rows x V), in their dtype."""
    log_ps, log_pt = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    ps, pt = log_ps.exp(), log_pt.exp()
    mode = divergence_mode(beta)
    if mode == FORWARD_KL:
        div = (pt * (log_pt - log_ps)).sum(-1)
    elif mode == REVERSE_KL:
        div = (ps * (log_ps - log_pt)).sum(-1)
    else:
        log_m = torch.logaddexp(log_ps + math.log(1 - beta), log_pt + math.log(beta))
        div = (beta * pt * (log_pt - log_m) + (1 - beta) * ps * (log_ps - log_m)).sum(-1)
    return div, -(ps * log_ps).sum(-1)


def _reduce(rows, valid_count, reduction, num_items_in_batch):
    if reduction == "none":
        return rows
    return rows.sum() * reduction_scale(valid_count, reduction, num_items_in_batch, rows.device)


def linear_jsd_reference(student_hidden, student_weight, teacher_hidden, teacher_weight, student_bias=None,
                         teacher_bias=None, *, beta=0.5, temperature=1.0, student_logit_scale=1.0,
                         teacher_logit_scale=1.0, student_softcap=None, teacher_softcap=None, mask=None,
                         reduction="mean", num_items_in_batch=None, return_entropy=False):
    """Materialises both heads' logits in fp32 (ground truth; the backend where Triton cannot run)."""
    hs = student_hidden.reshape(-1, student_hidden.shape[-1])
    ht = teacher_hidden.reshape(-1, teacher_hidden.shape[-1]).detach()
    zs = hs.float() @ student_weight.float().t()
    if student_bias is not None:
        zs = zs + student_bias.float()
    with torch.no_grad():
        zt = ht.float() @ teacher_weight.detach().float().t()
        if teacher_bias is not None:
            zt = zt + teacher_bias.detach().float()
    zs = transform_logits(zs, student_logit_scale, student_softcap, temperature)
    zt = transform_logits(zt, teacher_logit_scale, teacher_softcap, temperature)
    div, ent = divergence_rows_reference(zs, zt, beta)
    ent = ent.detach()
    valid = torch.ones(hs.shape[0], dtype=torch.bool, device=hs.device) if mask is None else mask.reshape(-1) != 0
    div, ent = div.masked_fill(~valid, 0), ent.masked_fill(~valid, 0)
    shape = student_hidden.shape[:-1]
    count = valid.sum()
    loss = _reduce(div, count, reduction, num_items_in_batch)
    if reduction == "none":
        loss = loss.view(shape)
    if not return_entropy:
        return loss
    entropy = ent.view(shape) if reduction == "none" else (
        ent.sum() if reduction == "sum" else ent.sum() / count.clamp(min=1))
    return loss, entropy


# 2. kernel ----------------------------------------------------------------------------------------
@triton.jit
def _transform(y, scale, cap, inv_t, HAS_CAP: tl.constexpr):
    z = y * scale
    if HAS_CAP:
        z = cap * (2 * tl.sigmoid(2 * z / cap) - 1)  # cap * tanh(z / cap); the interpreter has no tanh
    return z * inv_t


@triton.jit
def _divergence_rows_kernel(
    S, T, G, stride_s, stride_t, stride_g, DIV, ENT, DLOSS, dloss_stride, n_cols,
    beta, log_1m_beta, log_beta, inv_t, s_scale, s_cap, t_scale, t_cap,
    MODE: tl.constexpr, S_CAP: tl.constexpr, T_CAP: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per token. S and T: the raw fp32 logits (bias included) of student and teacher. Pass 1 folds
    # both rows into online log-sum-exps plus the sums that give the student's entropy and the two KLs; the
    # generalized JSD needs both normalisers for its mixture, hence pass 2; pass 3 writes d loss / d S times
    # DLOSS (per row, or one scalar when dloss_stride is 0) into G (G may be S itself).
    row = tl.program_id(0).to(tl.int64)
    s_row, t_row = S + row * stride_s, T + row * stride_t
    cols = tl.arange(0, BLOCK)
    zero = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), axis=0)
    m_s, m_t = zero - float("inf"), zero - float("inf")
    sum_s, sum_t = zero, zero
    s_dot_zs = zero  # sum e^(zs - m_s) * zs
    s_dot_gap = zero  # sum e^(zs - m_s) * (zs - zt)
    t_dot_gap = zero  # sum e^(zt - m_t) * (zt - zs)
    for start in range(0, n_cols, BLOCK):
        offs = start + cols
        mask = offs < n_cols
        zs = _transform(tl.load(s_row + offs, mask=mask, other=0.0).to(tl.float32), s_scale, s_cap, inv_t, S_CAP)
        zt = _transform(tl.load(t_row + offs, mask=mask, other=0.0).to(tl.float32), t_scale, t_cap, inv_t, T_CAP)
        gap = tl.where(mask, zs - zt, 0.0)
        zs = tl.where(mask, zs, -float("inf"))
        zt = tl.where(mask, zt, -float("inf"))
        new_m_s = tl.maximum(m_s, tl.max(zs, axis=0))
        new_m_t = tl.maximum(m_t, tl.max(zt, axis=0))
        a_s, a_t = tl.exp(m_s - new_m_s), tl.exp(m_t - new_m_t)
        e_s, e_t = tl.exp(zs - new_m_s), tl.exp(zt - new_m_t)  # 0 where masked
        sum_s = sum_s * a_s + tl.sum(e_s, axis=0)
        sum_t = sum_t * a_t + tl.sum(e_t, axis=0)
        s_dot_zs = s_dot_zs * a_s + tl.sum(e_s * tl.where(mask, zs, 0.0), axis=0)
        s_dot_gap = s_dot_gap * a_s + tl.sum(e_s * gap, axis=0)
        t_dot_gap = t_dot_gap * a_t - tl.sum(e_t * gap, axis=0)
        m_s, m_t = new_m_s, new_m_t
    lse_s = m_s + tl.log(sum_s)
    lse_t = m_t + tl.log(sum_t)
    tl.store(ENT + row, lse_s - s_dot_zs / sum_s)
    if MODE == 0:
        div = t_dot_gap / sum_t - lse_t + lse_s
        row_term = div
    elif MODE == 1:
        div = s_dot_gap / sum_s - lse_s + lse_t
        row_term = div
    else:
        div = zero
        row_term = zero  # KL(p_s || m), which the gradient subtracts
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            zs = _transform(tl.load(s_row + offs, mask=mask, other=0.0).to(tl.float32), s_scale, s_cap, inv_t,
                            S_CAP)
            zt = _transform(tl.load(t_row + offs, mask=mask, other=0.0).to(tl.float32), t_scale, t_cap, inv_t,
                            T_CAP)
            log_ps, log_pt = zs - lse_s, zt - lse_t
            a, b = log_ps + log_1m_beta, log_pt + log_beta
            top = tl.maximum(a, b)
            log_m = top + tl.log(tl.exp(a - top) + tl.exp(b - top))
            ps = tl.where(mask, tl.exp(log_ps), 0.0)
            pt = tl.where(mask, tl.exp(log_pt), 0.0)
            kl_s = tl.sum(ps * tl.where(mask, log_ps - log_m, 0.0), axis=0)
            div += beta * tl.sum(pt * tl.where(mask, log_pt - log_m, 0.0), axis=0) + (1 - beta) * kl_s
            row_term += kl_s
    tl.store(DIV + row, div)
    if WRITE_GRAD:
        d = tl.load(DLOSS + row * dloss_stride).to(tl.float32) * inv_t * s_scale
        g_row = G + row * stride_g
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            y = tl.load(s_row + offs, mask=mask, other=0.0).to(tl.float32) * s_scale
            if S_CAP:
                th = 2 * tl.sigmoid(2 * y / s_cap) - 1
                zs = s_cap * th * inv_t
            else:
                zs = y * inv_t
            zt = _transform(tl.load(t_row + offs, mask=mask, other=0.0).to(tl.float32), t_scale, t_cap, inv_t,
                            T_CAP)
            log_ps, log_pt = zs - lse_s, zt - lse_t
            ps = tl.exp(log_ps)
            if MODE == 0:  # d/dzs KL(p_t || p_s) = p_s - p_t
                g = ps - tl.exp(log_pt)
            elif MODE == 1:  # p_s * (log p_s - log p_t - KL)
                g = ps * (log_ps - log_pt - row_term)
            else:  # d JSD / d p_s = (1 - beta) log(p_s / m): (1 - beta) p_s (log p_s - log m - KL(p_s || m))
                a, b = log_ps + log_1m_beta, log_pt + log_beta
                top = tl.maximum(a, b)
                log_m = top + tl.log(tl.exp(a - top) + tl.exp(b - top))
                g = (1 - beta) * ps * (log_ps - log_m - row_term)
            g = g * d
            if S_CAP:
                g = g * (1 - th * th)
            tl.store(g_row + offs, g.to(G.dtype.element_ty), mask=mask)


# 3. launchers -------------------------------------------------------------------------------------
# Bytes of one chunk's tiles together (two fp32 logits tiles, plus a gradient tile in the GEMM dtype when it is
# not fp32): 1 GiB holds ~830 tokens at a 128k vocabulary (bf16 GEMMs).
TUNING = {"chunk_bytes": 1024 * 2**20, "chunk_rows": None, "block": 4096, "num_warps": 16}


def _rows_per_chunk(n_cols: int, gemm_dtype: torch.dtype, chunk_bytes: int | None) -> int:
    if TUNING["chunk_rows"]:
        return int(TUNING["chunk_rows"])
    per_row = n_cols * (8 + (0 if gemm_dtype == torch.float32 else torch.finfo(gemm_dtype).bits // 8))
    return max(16, (chunk_bytes or TUNING["chunk_bytes"]) // per_row // 16 * 16)


def _launch_rows(s_tile, t_tile, g_tile, div, ent, dloss, params, write_grad):
    n_rows, n_cols = s_tile.shape
    if n_rows == 0:
        return
    beta = params["beta"]
    block = min(TUNING["block"], triton.next_power_of_2(n_cols))
    dl = dloss if dloss is not None else div  # (not read)
    _divergence_rows_kernel[(n_rows,)](
        s_tile, t_tile, g_tile, s_tile.stride(0), t_tile.stride(0), g_tile.stride(0), div, ent,
        dl, 0 if dl.dim() == 0 else 1, n_cols,
        float(beta), math.log(1 - beta) if beta < 1 else 0.0, math.log(beta) if beta > 0 else 0.0,
        1.0 / params["temperature"], float(params["s_scale"]), float(params["s_cap"] or 1.0),
        float(params["t_scale"]), float(params["t_cap"] or 1.0),
        MODE=divergence_mode(beta), S_CAP=params["s_cap"] is not None, T_CAP=params["t_cap"] is not None,
        WRITE_GRAD=write_grad, BLOCK=block, num_warps=TUNING["num_warps"] if block >= 2048 else 4)


def _logits_fp32(out, h, w, b):
    """out = h @ w.T (+ b) in fp32: on CUDA from the GEMM dtype with fp32 accumulation and output."""
    if h.dtype == torch.float32:
        torch.mm(h, w.t(), out=out)
    elif h.device.type == "cuda":
        torch.mm(h, w.t(), out_dtype=torch.float32, out=out)
    else:  # CPU (the interpreter's tests): products of the same low-precision values, in fp32
        torch.mm(h.float(), w.float().t(), out=out)
    if b is not None:
        out.add_(b.float())


def _chunked_pass(hs, ws, bs, ht, wt, bt, rows, params, dloss, want, dw_dtype, chunk_bytes):
    """One pass over the token rows ``rows``, chunk by chunk. Returns per-row (divergence, entropy) and
    (dh, dw, db) for the incoming gradient ``dloss`` (a device scalar or one value per row of ``rows``; None:
    no gradient)."""
    want_dh, want_dw, want_db = want if dloss is not None else (False, False, False)
    write_grad = want_dh or want_dw or want_db
    n, n_cols = rows.numel(), ws.shape[0]
    f32 = dict(dtype=torch.float32, device=hs.device)
    div, ent = torch.empty(n, **f32), torch.empty(n, **f32)
    dh = torch.zeros(hs.shape, dtype=hs.dtype, device=hs.device) if want_dh else None
    dw = (torch.empty(ws.shape, dtype=dw_dtype, device=ws.device) if n
          else torch.zeros(ws.shape, dtype=dw_dtype, device=ws.device)) if want_dw else None
    db = torch.zeros(n_cols, **f32) if want_db else None
    step = min(_rows_per_chunk(n_cols, hs.dtype, chunk_bytes), max(n, 1))
    s_buf, t_buf = torch.empty((step, n_cols), **f32), torch.empty((step, n_cols), **f32)
    g_buf = s_buf if hs.dtype == torch.float32 or not write_grad else hs.new_empty((step, n_cols))
    for start in range(0, n, step):
        end = min(start + step, n)
        idx = rows[start:end]
        h_s = hs.index_select(0, idx)
        s_tile, t_tile, g_tile = s_buf[: end - start], t_buf[: end - start], g_buf[: end - start]
        _logits_fp32(s_tile, h_s, ws, bs)
        _logits_fp32(t_tile, ht.index_select(0, idx), wt, bt)
        d = None if dloss is None else (dloss if dloss.dim() == 0 else dloss[start:end])
        _launch_rows(s_tile, t_tile, g_tile, div[start:end], ent[start:end], d, params, write_grad)
        if want_dh:
            dh.index_copy_(0, idx, torch.mm(g_tile, ws))
        if want_dw:
            _weight_gradient_gemm(dw, g_tile.t(), h_s, first=start == 0)
        if want_db:
            db += g_tile.sum(0, dtype=torch.float32)
    return div, ent, (dh, dw, db)


# 4. autograd --------------------------------------------------------------------------------------
def _operands(hidden, weight, bias):
    """The weight and bias in hidden's dtype (the GEMM dtype)."""
    return weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype)


class _LinearJSDFunction(torch.autograd.Function):
    """Inputs: 2-D hiddens in their GEMM dtypes, the caller's weights/biases (an fp32 master weight under
    autocast: cast here, its gradient returned in fp32), the valid rows, and the reduction's device scalar
    (None for "none")."""

    @staticmethod
    def forward(ctx, hs, ws, bs, ht, wt, bt, rows, scale, params, chunk_bytes, dw_fp32):
        want = tuple(ctx.needs_input_grad[:3])
        ctx.want, ctx.params, ctx.chunk_bytes, ctx.used = want, params, chunk_bytes, False
        ctx.weight_dtype, ctx.bias_dtype = ws.dtype, (bs.dtype if bs is not None else None)
        ctx.dw_dtype = torch.float32 if (dw_fp32 or ws.dtype == torch.float32) else hs.dtype
        ctx.grad_in_forward = scale is not None and not gradient_in_backward(hs.dtype)
        w_s, b_s = _operands(hs, ws, bs)
        w_t, b_t = _operands(ht, wt, bt)
        div, ent, grads = _chunked_pass(hs, w_s, b_s, ht, w_t, b_t, rows, params,
                                        scale if ctx.grad_in_forward else None, want, ctx.dw_dtype, chunk_bytes)
        if ctx.grad_in_forward:
            ctx.grads = grads
        else:
            ctx.save_for_backward(hs, ws, bs, ht, wt, bt, rows, scale)
        ctx.mark_non_differentiable(ent)
        return (div if scale is None else div.sum() * scale), ent

    @staticmethod
    def backward(ctx, dloss, _dent):
        if ctx.used and ctx.grad_in_forward:
            raise RuntimeError("linear_jsd: backward ran twice through a loss whose gradients are computed in "
                               "the forward; use reduction='none' for retain_graph")
        ctx.used = True
        if dloss is None:
            return (None,) * 11
        if ctx.grad_in_forward:
            grads = tuple(None if g is None else scale_unless_one_(g, dloss.float()) for g in ctx.grads)
            ctx.grads = None
        else:
            hs, ws, bs, ht, wt, bt, rows, scale = ctx.saved_tensors
            d = dloss.float().contiguous() if scale is None else dloss.float() * scale
            w_s, b_s = _operands(hs, ws, bs)
            w_t, b_t = _operands(ht, wt, bt)
            _, _, grads = _chunked_pass(hs, w_s, b_s, ht, w_t, b_t, rows, ctx.params, d, ctx.want, ctx.dw_dtype,
                                        ctx.chunk_bytes)
        dh, dw, db = grads
        if dw is not None and dw.dtype != ctx.weight_dtype:
            dw = dw.to(ctx.weight_dtype)
        if db is not None:
            db = db.to(ctx.bias_dtype)
        return dh, dw, db, None, None, None, None, None, None, None, None


# 5. public function -------------------------------------------------------------------------------
def _check_head(op, who, hidden, weight, bias, autocast):
    check_float_tensor(op, f"{who}_hidden", hidden)
    check_float_tensor(op, f"{who}_weight", weight)
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: expected {who}_hidden [..., H] and {who}_weight [V, H]; got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if not autocast:
        check_same_dtype(op, **{f"{who}_hidden": hidden, f"{who}_weight": weight})
    if bias is not None:
        check_float_tensor(op, f"{who}_bias", bias)
        check_same_dtype(op, **{f"{who}_weight": weight, f"{who}_bias": bias})
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"{op}: {who}_bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")


def _check_scalars(op, beta, temperature, scales, softcaps, reduction, num_items_in_batch, chunk_bytes):
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta <= 1:
        raise ValueError(f"{op}: beta must be a number in [0, 1] (0 forward KL, 1 reverse KL), got {beta!r}")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"{op}: temperature must be a finite number > 0, got {temperature!r}")
    for name, value in scales.items():
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value == 0:
            raise ValueError(f"{op}: {name} must be a finite non-zero number, got {value!r}")
    for name, value in softcaps.items():
        if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0):
            raise ValueError(f"{op}: {name} must be None or a finite number > 0, got {value!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if num_items_in_batch is not None and reduction != "mean":
        raise ValueError(f"{op}: num_items_in_batch applies to reduction='mean', got reduction={reduction!r}")
    if chunk_bytes is not None and (not isinstance(chunk_bytes, int) or chunk_bytes <= 0):
        raise ValueError(f"{op}: chunk_bytes must be a positive int (bytes of one chunk's tiles), got "
                         f"{chunk_bytes!r}")


def linear_jsd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    student_bias: torch.Tensor | None = None,
    teacher_bias: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    student_logit_scale: float = 1.0,
    teacher_logit_scale: float = 1.0,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
    mask: torch.Tensor | None = None,
    reduction: str = "mean",
    num_items_in_batch=None,
    return_entropy: bool = False,
    accum_dtype: torch.dtype | None = torch.float32,
    chunk_bytes: int | None = None,
):
    """Divergence between the student's and the teacher's next-token distributions (see the module
    docstring) from their hidden states ``[..., H_s]`` / ``[..., H_t]`` (same leading shape) and LM heads
    ``[V, H_s]`` / ``[V, H_t]`` (+ biases ``[V]``), without the [N, V] logits.

    ``mask`` (hidden's leading shape; nonzero = scored, e.g. ``labels != -100``) selects the tokens. Returns the
    loss (a scalar; with reduction="none" one value per token, 0 where masked), or ``(loss, student_entropy)``
    with ``return_entropy``. The gradient reaches student_hidden, student_weight and student_bias only.
    ``accum_dtype``: the student weight's gradient accumulates across chunks in fp32 (default; cast to the
    weight's dtype once at the end, as TRL's kernel does) or, with None, in the weight's dtype (each chunk's
    GEMM still accumulates in fp32), which saves an fp32 [V, H] buffer. ``chunk_bytes`` bounds one chunk's
    tiles (default ``TUNING["chunk_bytes"]``, 1 GiB).
    """
    op = "linear_jsd"
    device_type = student_hidden.device.type
    autocast = torch.is_autocast_enabled(device_type)
    _check_head(op, "student", student_hidden, student_weight, student_bias, autocast)
    _check_head(op, "teacher", teacher_hidden, teacher_weight, teacher_bias, autocast)
    check_same_device(op, student_hidden=student_hidden, student_weight=student_weight, student_bias=student_bias,
                      teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, teacher_bias=teacher_bias,
                      mask=mask)
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"{op}: student and teacher must share the vocabulary; got {student_weight.shape[0]} "
                         f"and {teacher_weight.shape[0]} rows in their heads")
    if student_hidden.shape[:-1] != teacher_hidden.shape[:-1]:
        raise ValueError(f"{op}: student_hidden {tuple(student_hidden.shape)} and teacher_hidden "
                         f"{tuple(teacher_hidden.shape)} must have the same leading shape (one row per token)")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != student_hidden.shape[:-1]):
        got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"{op}: mask must be a tensor of shape {tuple(student_hidden.shape[:-1])}, got {got}")
    _check_scalars(op, beta, temperature, {"student_logit_scale": student_logit_scale,
                                           "teacher_logit_scale": teacher_logit_scale},
                   {"student_softcap": student_softcap, "teacher_softcap": teacher_softcap}, reduction,
                   num_items_in_batch, chunk_bytes)
    if accum_dtype not in (None, torch.float32):
        raise ValueError(f"{op}: accum_dtype must be torch.float32 or None (the weight's dtype), got {accum_dtype!r}")
    if autocast:  # the GEMMs in the autocast dtype, as nn.Linear under autocast
        dtype = torch.get_autocast_dtype(device_type)
        student_hidden, teacher_hidden = student_hidden.to(dtype), teacher_hidden.to(dtype)
    options = dict(beta=beta, temperature=temperature, student_logit_scale=student_logit_scale,
                   teacher_logit_scale=teacher_logit_scale, student_softcap=student_softcap,
                   teacher_softcap=teacher_softcap, mask=mask, reduction=reduction,
                   num_items_in_batch=num_items_in_batch, return_entropy=return_entropy)
    if not use_triton(student_hidden.device):
        return linear_jsd_reference(student_hidden, student_weight, teacher_hidden, teacher_weight, student_bias,
                                    teacher_bias, **options)
    shape = student_hidden.shape[:-1]
    hs = student_hidden.reshape(-1, student_hidden.shape[-1])
    ht = teacher_hidden.reshape(-1, teacher_hidden.shape[-1]).detach()
    n = hs.shape[0]
    if mask is None:
        rows = torch.arange(n, device=hs.device)
    else:  # one host sync: masked tokens (prompt, padding) get no GEMM work
        rows = (mask.reshape(-1) != 0).nonzero().squeeze(1)
    count = torch.as_tensor(rows.numel(), device=hs.device)
    scale = None if reduction == "none" else reduction_scale(count, reduction, num_items_in_batch, hs.device)
    params = dict(beta=float(beta), temperature=float(temperature), s_scale=float(student_logit_scale),
                  t_scale=float(teacher_logit_scale), s_cap=None if student_softcap is None else float(student_softcap),
                  t_cap=None if teacher_softcap is None else float(teacher_softcap))
    wt, bt = teacher_weight.detach(), None if teacher_bias is None else teacher_bias.detach()
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (student_hidden, student_weight, student_bias))
    with torch.autocast(device_type, enabled=False):
        if needs_grad:
            loss, ent = _LinearJSDFunction.apply(hs, student_weight, student_bias, ht, wt, bt, rows, scale, params,
                                                 chunk_bytes, accum_dtype is torch.float32)
        else:
            w_s, b_s = _operands(hs, student_weight, student_bias)
            w_t, b_t = _operands(ht, wt, bt)
            div, ent, _ = _chunked_pass(hs, w_s, b_s, ht, w_t, b_t, rows, params, None, (False,) * 3,
                                        torch.float32, chunk_bytes)
            loss = div if scale is None else div.sum() * scale
    if reduction == "none":
        loss = loss.new_zeros(n).index_copy(0, rows, loss).view(shape)
    if not return_entropy:
        return loss
    if reduction == "none":
        return loss, ent.new_zeros(n).index_copy_(0, rows, ent).view(shape)
    total = ent.sum()
    return loss, total if reduction == "sum" else total / count.clamp(min=1).to(torch.float32)
