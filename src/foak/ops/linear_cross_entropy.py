"""Linear layer + cross-entropy (the LM head and its loss) without materialising the [N, V] logits.

``linear_cross_entropy(hidden, weight, target, bias=None, shift=False, **loss_options)`` equals
``cross_entropy(hidden @ weight.T + bias, target, **loss_options)`` (see ``ops/cross_entropy.py`` for the
options; the per-class weights are ``class_weight`` here, since ``weight`` is the LM head's). Rows are
processed in chunks sized to a fixed memory budget; rows whose target is ignored are skipped entirely (no
GEMM work). ``shift=True`` takes hidden ``[B, S, H]`` and unshifted labels ``[B, S]`` and predicts token
``s + 1`` from position ``s`` by shifting the labels, never the hidden states.

Precision follows ``nn.Linear`` + an fp32 loss: under torch autocast the GEMMs run in the autocast dtype
(hidden and weight are cast as autocast casts a linear layer's inputs) and an fp32 master weight gets an
fp32 gradient, accumulated in fp32 across chunks; without autocast they run in the inputs' dtype.
``accum_dtype=torch.float32`` also accumulates a bf16/fp16 weight's gradient in fp32 (cast once at the end).
"""

from __future__ import annotations

import torch

from foak.backend import use_triton
from foak.ops._checks import check_float_tensor, check_same_device, check_same_dtype
from foak.ops._custom_op import custom_op
from foak.ops.cross_entropy import (
    _check_targets,
    ce_launch,
    check_class_weight,
    check_loss_options,
    cross_entropy_reference,
    gradient_in_backward,
    loss_options,
    reduction_scale,
    scale_unless_one_,
    stats_mean,
    target_weight_total,
)


# 1. reference -------------------------------------------------------------------------------------
def shift_labels(target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """[B, S] labels -> labels for "position s predicts token s + 1" (last position ignored)."""
    return torch.nn.functional.pad(target[..., 1:], (0, 1), value=ignore_index)


def linear_cross_entropy_reference(hidden, weight, target, bias=None, shift=False, ignore_index=-100,
                                   class_weight=None, **loss_options):
    """Materialises the logits in fp32 (ground truth for tests)."""
    if shift:
        target = shift_labels(target, ignore_index)
    logits = hidden.reshape(-1, hidden.shape[-1]).float() @ weight.float().t()
    if bias is not None:
        logits = logits + bias.float()
    return cross_entropy_reference(logits, target.reshape(-1), ignore_index=ignore_index, weight=class_weight,
                                   **loss_options)


# 2-3. kernels and launchers: the row kernel of ops/cross_entropy.py runs on each chunk of logits ----
# Rows per chunk: the [rows, V] logits chunk (which then holds its own gradient) stays under chunk_bytes.
# Launch knobs, swept on the GPU by benchmarks/tune_ops.py; chunk_rows overrides the budget (tests).
# At hidden [8192, 4096] x weight [128256, 4096] bf16 on the H200, fwd+bwd took 41.8 / 39.7 / 37.5 / 35.5 ms
# with 96 / 112 / 128 / 192 MiB chunks: larger chunks mean fewer read-modify-write passes over the weight
# gradient. 112 MiB keeps the whole extra memory (chunk + gathered rows) under 128 MiB.
TUNING = {"chunk_bytes": 112 * 2**20, "chunk_rows": None}


def _rows_per_chunk(n_classes: int, element_size: int, chunk_bytes: int | None = None) -> int:
    """Rows of one [rows, V] logits chunk within the budget: a multiple of 128 from 1024 rows on (the chunk is the
    M dimension of its GEMMs, whose tiles are 128 or 256 rows: 2080 rows would leave a last tile of 32), else of 16."""
    if TUNING["chunk_rows"]:
        return int(TUNING["chunk_rows"])
    rows = (chunk_bytes or TUNING["chunk_bytes"]) // (n_classes * element_size)
    return rows // 128 * 128 if rows >= 1024 else max(16, rows // 16 * 16)


def _weight_gradient_gemm(dw: torch.Tensor, g_t: torch.Tensor, h: torch.Tensor, first: bool) -> None:
    """dw (+)= g_t @ h, accumulating in dw's dtype (fp32 for low-precision g_t, h when dw is fp32)."""
    if dw.dtype == g_t.dtype:
        torch.mm(g_t, h, out=dw) if first else dw.addmm_(g_t, h)
    elif dw.device.type == "cuda":  # cuBLAS: bf16/fp16 operands, fp32 accumulate and output
        if first:
            torch.mm(g_t, h, out_dtype=dw.dtype, out=dw)
        else:
            torch.addmm(dw, g_t, h, out_dtype=dw.dtype, out=dw)
    else:  # CPU (the interpreter's tests): products of the same low-precision values, summed in fp32
        g_t, h = g_t.to(dw.dtype), h.to(dw.dtype)
        torch.mm(g_t, h, out=dw) if first else dw.addmm_(g_t, h)


def _chunked_pass(hidden, weight, bias, target, valid_rows, options, dloss, stats=None, want=(True, True, True),
                  class_weight=None, row_stats=False, dw_dtype=None):
    """One pass over the non-ignored rows, chunk by chunk: logits = h W^T (+ b), the row kernel turns them
    into loss terms and (in place) into d loss / d logits times ``dloss``, and GEMMs fold that into the
    gradients of hidden, weight (accumulated in ``dw_dtype``) and bias. ``stats`` given: a backward
    (gradients only). Returns (loss, stats, z_loss, accuracy, entropy) per valid row (None in a backward)
    and (dh, dw, db)."""
    want_dh, want_dw, want_db = want
    options = dict(options)
    chunk_bytes = options.pop("chunk_bytes", None)
    n_valid = valid_rows.numel()
    forward = stats is None
    f32 = dict(dtype=torch.float32, device=hidden.device)
    if forward:
        loss, stats, z_loss = torch.empty(n_valid, **f32), torch.empty((2, n_valid), **f32), torch.empty(n_valid, **f32)
        acc, ent = (torch.empty(n_valid, **f32), torch.empty(n_valid, **f32)) if row_stats else (None, None)
    dh = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device) if want_dh else None
    # the first chunk's GEMM writes dw (no zero fill, no read of zeros); later chunks accumulate into it
    dw_dtype = dw_dtype or weight.dtype
    dw = (torch.empty(weight.shape, dtype=dw_dtype, device=weight.device) if n_valid
          else torch.zeros(weight.shape, dtype=dw_dtype, device=weight.device)) if want_dw else None
    db = torch.zeros(weight.shape[0], **f32) if want_db else None
    write_grad = want_dh or want_dw or want_db
    class_weight_sum = None if class_weight is None else class_weight.sum(dtype=torch.float32)  # once, not per chunk
    step = min(_rows_per_chunk(weight.shape[0], hidden.element_size(), chunk_bytes), max(n_valid, 1))
    # one set of chunk buffers, reused: a new chunk never coexists with the previous one
    logits_buf = hidden.new_empty((step, weight.shape[0]))
    h_buf = hidden.new_empty((step, hidden.shape[1]))
    dh_buf = hidden.new_empty((step, hidden.shape[1])) if want_dh else None
    for start in range(0, n_valid, step):
        end = min(start + step, n_valid)
        rows = valid_rows[start:end]
        h = torch.index_select(hidden, 0, rows, out=h_buf[: end - start])
        logits = logits_buf[: end - start]
        if bias is not None:
            torch.addmm(bias, h, weight.t(), out=logits)
        else:
            torch.mm(h, weight.t(), out=logits)
        d = dloss if dloss.dim() == 0 else dloss[start:end]
        out = ce_launch(logits, target.index_select(0, rows), grad=logits if write_grad else None, dloss=d,
                        stats=None if forward else stats[:, start:end].contiguous(), class_weight=class_weight,
                        class_weight_sum=class_weight_sum, row_stats=row_stats and forward, **options)
        if forward:
            loss[start:end], stats[:, start:end], z_loss[start:end] = out[0], out[1], out[2]
            if row_stats:
                acc[start:end], ent[start:end] = out[3], out[4]
        if want_dh:
            dh.index_copy_(0, rows, torch.mm(logits, weight, out=dh_buf[: end - start]))
        if want_dw:
            _weight_gradient_gemm(dw, logits.t(), h, first=start == 0)
        if want_db:
            db += logits.sum(0, dtype=torch.float32)
    rows_out = (loss, stats, z_loss, acc, ent) if forward else None
    return rows_out, (dh, dw, db)


def _valid_rows(target, ignore_index):
    # one host sync per call: it lets ignored rows (prompt tokens, padding) skip all GEMM work
    return (target != ignore_index).nonzero().squeeze(1)


def _scatter_rows(values, valid_rows, n_rows):
    return values.new_zeros(n_rows).index_copy_(0, valid_rows, values)


def _grads_out(grads, hidden, weight):
    """Gradients in the dtypes of what they are for (an fp32-accumulated bf16 weight's is cast once);
    empty tensors stand for the ones not wanted (custom ops return no None)."""
    dh, dw, db = grads
    if dw is not None and dw.dtype != weight.dtype:
        dw = dw.to(weight.dtype)
    return (dh if dh is not None else hidden.new_empty(0), dw if dw is not None else weight.new_empty(0),
            db if db is not None else weight.new_empty(0, dtype=torch.float32))


# 4. custom ops and autograd -----------------------------------------------------------------------
def _grad_fakes(hidden, weight, want_dh, want_dw, want_db):
    return (hidden.new_empty(hidden.shape if want_dh else 0), weight.new_empty(weight.shape if want_dw else 0),
            weight.new_empty(weight.shape[0] if want_db else 0, dtype=torch.float32))


def _forward_fake(hidden, weight, bias, target, scale, class_weight, options_key, want_dh, want_dw, want_db,
                  row_stats, dw_fp32):
    n, f32 = hidden.shape[0], dict(dtype=torch.float32)
    rows = hidden.new_empty(n, **f32)
    extra = rows.new_empty(n if row_stats else 0)
    return (rows, rows.new_empty((2, n)), rows.new_empty(n), extra, extra.new_empty(extra.shape),
            *_grad_fakes(hidden, weight, want_dh, want_dw, want_db))


def _compute_operands(hidden, weight, bias, dw_fp32):
    """The weight and bias in hidden's dtype (the GEMM dtype) and the weight gradient's accumulation dtype."""
    w = weight.to(hidden.dtype)
    b = None if bias is None else bias.to(hidden.dtype)
    accumulate = torch.float32 if (dw_fp32 or weight.dtype == torch.float32) else w.dtype
    return w, b, accumulate


@custom_op("linear_cross_entropy_forward", _forward_fake)
def _forward_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
    scale: torch.Tensor | None, class_weight: torch.Tensor | None, options_key: str, want_dh: bool,
    want_dw: bool, want_db: bool, row_stats: bool, dw_fp32: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """Per-row loss, stats ([2, N]: max and log-sum-exp relative to it), z-loss, accuracy and entropy
    (0 where ignored; the last two empty unless row_stats) and, when scale is given, the gradients (times
    scale) of hidden, weight and bias (empty where not wanted). The GEMMs run in hidden's dtype."""
    options = _decode(options_key)
    valid = _valid_rows(target, options["ignore_index"])
    w, b, accumulate = _compute_operands(hidden, weight, bias, dw_fp32)
    dloss = scale if scale is not None else torch.ones((), dtype=torch.float32, device=hidden.device)
    want = (want_dh, want_dw, want_db) if scale is not None else (False, False, False)
    (loss, stats, z_loss, acc, ent), grads = _chunked_pass(
        hidden, w, b, target, valid, options, dloss, want=want, class_weight=class_weight, row_stats=row_stats,
        dw_dtype=accumulate)
    n = hidden.shape[0]
    full_stats = stats.new_zeros((2, n)).index_copy_(1, valid, stats)
    extras = ((_scatter_rows(acc, valid, n), _scatter_rows(ent, valid, n)) if row_stats
              else (hidden.new_empty(0, dtype=torch.float32), hidden.new_empty(0, dtype=torch.float32)))
    return (_scatter_rows(loss, valid, n), full_stats, _scatter_rows(z_loss, valid, n), *extras,
            *_grads_out(grads, hidden, weight))


def _backward_fake(dloss, hidden, weight, bias, target, stats, class_weight, options_key, want_dh, want_dw,
                   want_db, dw_fp32):
    return _grad_fakes(hidden, weight, want_dh, want_dw, want_db)


@custom_op("linear_cross_entropy_backward", _backward_fake)
def _backward_op(
    dloss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    target: torch.Tensor, stats: torch.Tensor, class_weight: torch.Tensor | None, options_key: str,
    want_dh: bool, want_dw: bool, want_db: bool, dw_fp32: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for the incoming gradient ``dloss``: per row [N], or one scalar for every row."""
    options = _decode(options_key)
    valid = _valid_rows(target, options["ignore_index"])
    w, b, accumulate = _compute_operands(hidden, weight, bias, dw_fp32)
    d = dloss.float() if dloss.dim() == 0 else dloss.float().index_select(0, valid)
    _, grads = _chunked_pass(hidden, w, b, target, valid, options, d, stats=stats.index_select(1, valid),
                             want=(want_dh, want_dw, want_db), class_weight=class_weight, dw_dtype=accumulate)
    return _grads_out(grads, hidden, weight)


_OPTION_NAMES = ("ignore_index", "label_smoothing", "lse_square_scale", "logits_scaling", "softcap", "chunk_bytes")


def _encode(options: dict) -> str:
    # custom-op schemas take no dicts: the loss options travel as one string
    return repr(tuple(options[k] for k in _OPTION_NAMES))


def _decode(key: str) -> dict:
    import ast

    return dict(zip(_OPTION_NAMES, ast.literal_eval(key)))


class _LinearCrossEntropyFunction(torch.autograd.Function):
    """hidden is in the GEMM dtype; weight and bias are the caller's (an fp32 master weight under autocast):
    the op casts them itself and returns their gradients in their own dtypes."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, scale, class_weight, options_key, reduction, row_stats,
                dw_fp32, precompute_row_grad):
        want = tuple(ctx.needs_input_grad[:3])
        ctx.want, ctx.options_key, ctx.reduction, ctx.dw_fp32, ctx.used = want, options_key, reduction, dw_fp32, False
        ctx.bias_dtype = bias.dtype if bias is not None else None
        # the gradient is computed in the forward for mean/sum (and for "none" when the caller says every row
        # gets the same incoming gradient), except for fp16, where it would underflow before the loss scale
        ctx.grad_in_forward = not gradient_in_backward(hidden.dtype) and (
            reduction != "none" or (precompute_row_grad and not torch.compiler.is_compiling()))
        forward_scale = (scale if reduction != "none" else torch.ones((), dtype=torch.float32, device=hidden.device)
                         ) if ctx.grad_in_forward else None
        loss, stats, z_loss, acc, ent, dh, dw, db = _forward_op(hidden, weight, bias, target, forward_scale,
                                                                class_weight, options_key, *want, row_stats, dw_fp32)
        if ctx.grad_in_forward:
            ctx.grads = (dh, dw, db)
        if not ctx.grad_in_forward or reduction == "none":
            ctx.save_for_backward(hidden, weight, bias, target, stats, class_weight, scale)
        if reduction != "none":
            loss, z_loss = loss.sum() * scale, z_loss.sum() * scale
        ctx.mark_non_differentiable(z_loss, acc, ent)
        return loss, z_loss, acc, ent

    @staticmethod
    def backward(ctx, dloss, _dz, _dacc, _dent):
        if ctx.grad_in_forward and ctx.used:
            raise RuntimeError(
                "linear_cross_entropy: backward ran twice through a loss whose gradients are computed in the "
                "forward and consumed by the first backward. Use reduction='none' without precompute_row_grad "
                "for retain_graph."
            )
        ctx.used = True
        grads = None
        if ctx.grad_in_forward and ctx.reduction != "none":
            grads = tuple(scale_unless_one_(g, dloss.float()) if g.numel() else g for g in ctx.grads)
        elif ctx.grad_in_forward:
            # precompute_row_grad: valid when every non-ignored row's incoming gradient is the same (one sync)
            hidden, weight, bias, target, stats, class_weight, scale = ctx.saved_tensors
            d = dloss.float()[target != _decode(ctx.options_key)["ignore_index"]]
            first = d[:1]
            if not d.numel() or bool((d == first).all()):
                factor = first.reshape(()) if d.numel() else torch.zeros((), device=d.device)
                grads = tuple(scale_unless_one_(g, factor) if g.numel() else g for g in ctx.grads)
        ctx.grads = None
        if grads is None:  # computed now, with the incoming gradient
            hidden, weight, bias, target, stats, class_weight, scale = ctx.saved_tensors
            d = dloss.contiguous() if ctx.reduction == "none" else dloss.float() * scale
            grads = _backward_op(d, hidden, weight, bias, target, stats, class_weight, ctx.options_key, *ctx.want,
                                 ctx.dw_fp32)
        dh, dw, db = (g if want and g.numel() else None for g, want in zip(grads, ctx.want))
        if db is not None:
            db = db.to(ctx.bias_dtype)
        return dh, dw, db, None, None, None, None, None, None, None, None


# 5. public function -------------------------------------------------------------------------------
ACCUM_DTYPES = (None, torch.float32)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    shift: bool = False,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    logits_scaling: float = 1.0,
    num_items_in_batch=None,
    class_weight: torch.Tensor | None = None,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    return_entropy: bool = False,
    precompute_row_grad: bool = False,
    accum_dtype: torch.dtype | None = None,
    chunk_bytes: int | None = None,
):
    """``cross_entropy(hidden @ weight.T + bias, target, ...)`` without the [N, V] logits.

    hidden ``[..., H]`` and target ``[...]`` (with ``shift=True``: hidden ``[B, S, H]`` and the unshifted
    labels ``[B, S]``); weight ``[V, H]`` (may be tied to an embedding); bias ``[V]`` or None. Gradients:
    hidden, weight (fp32 accumulation inside each chunk's GEMM; across chunks in fp32 for an fp32 weight,
    under autocast included, or with ``accum_dtype=torch.float32``, else in the weight's dtype) and bias
    (fp32). With reduction="none" the result has target's shape. Returns the loss, or ``(loss, [z_loss],
    [token_accuracy], [entropy])`` with the requested extras in that order (as :func:`cross_entropy`).

    ``precompute_row_grad`` (reduction="none"): compute the gradient in the forward, as for a sum, on the
    promise that every non-ignored row will get the same incoming gradient (TRL sums the per-token losses);
    the backward checks the promise (one host sync) and recomputes the gradient exactly when it is broken.

    ``chunk_bytes`` bounds the [rows, V] logits chunk (default ``TUNING["chunk_bytes"]``, 112 MiB): larger
    chunks mean fewer passes over the weight gradient (faster) for more transient memory.
    """
    op = "linear_cross_entropy"
    check_float_tensor(op, "hidden", hidden)
    check_float_tensor(op, "weight", weight)
    device_type = hidden.device.type
    autocast = torch.is_autocast_enabled(device_type)
    if not autocast:
        check_same_dtype(op, hidden=hidden, weight=weight)
    check_same_device(op, hidden=hidden, weight=weight, bias=bias, target=target)
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{op}: expected hidden [..., H] and weight [V, H]; got hidden {tuple(hidden.shape)} and weight "
            f"{tuple(weight.shape)}"
        )
    if bias is not None:
        check_float_tensor(op, "bias", bias)
        check_same_dtype(op, weight=weight, bias=bias)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"{op}: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if shift:
        if hidden.dim() != 3 or not isinstance(target, torch.Tensor) or target.shape != hidden.shape[:2]:
            got = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
            raise ValueError(
                f"{op}: shift=True expects hidden [B, S, H] and unshifted labels [B, S]; got hidden "
                f"{tuple(hidden.shape)} and target {got}"
            )
        target = shift_labels(target, ignore_index)
    n_rows = hidden.numel() // hidden.shape[-1] if hidden.shape[-1] else 0
    if isinstance(target, torch.Tensor) and target.shape != hidden.shape[:-1]:
        raise ValueError(
            f"{op}: target has shape {tuple(target.shape)}; expected hidden's leading shape {tuple(hidden.shape[:-1])}"
        )
    _check_targets(op, target, n_rows, weight.shape[0], ignore_index, hidden.device)
    check_loss_options(op, reduction, label_smoothing, lse_square_scale, softcap, logits_scaling, num_items_in_batch)
    class_weight = check_class_weight(op, "class_weight", class_weight, weight.shape[0], hidden.device,
                                      lse_square_scale)
    if chunk_bytes is not None and (not isinstance(chunk_bytes, int) or chunk_bytes <= 0):
        raise ValueError(f"{op}: chunk_bytes must be a positive int (bytes of one logits chunk), got {chunk_bytes!r}")
    if accum_dtype not in ACCUM_DTYPES:
        raise ValueError(f"{op}: accum_dtype must be None (the weight's dtype) or torch.float32, got {accum_dtype!r}")
    if precompute_row_grad and reduction != "none":
        raise ValueError(f"{op}: precompute_row_grad applies to reduction='none' (mean/sum always compute the "
                         f"gradient in the forward), got reduction={reduction!r}")
    options = loss_options(ignore_index, label_smoothing, lse_square_scale, logits_scaling, softcap)
    extras_wanted = dict(return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy,
                         return_entropy=return_entropy)
    if autocast:  # the GEMMs in the autocast dtype, as nn.Linear under autocast
        hidden = hidden.to(torch.get_autocast_dtype(device_type))
    if not use_triton(hidden.device):
        return linear_cross_entropy_reference(hidden, weight, target, bias, reduction=reduction,
                                              num_items_in_batch=num_items_in_batch, class_weight=class_weight,
                                              **extras_wanted, **options)
    hidden2 = hidden.reshape(-1, hidden.shape[-1])
    target1 = target.reshape(-1)
    key = _encode({**options, "chunk_bytes": chunk_bytes})
    valid_count = (target1 != ignore_index).sum()
    weight_total = None if class_weight is None else target_weight_total(class_weight, target1, ignore_index)
    scale = None if reduction == "none" else reduction_scale(valid_count, reduction, num_items_in_batch,
                                                             hidden.device, weight_total)
    row_stats = bool(return_token_accuracy or return_entropy)
    dw_fp32 = accum_dtype is torch.float32
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    with torch.autocast(device_type, enabled=False):
        if needs_grad:
            loss, z_loss, acc, ent = _LinearCrossEntropyFunction.apply(
                hidden2, weight, bias, target1, scale, class_weight, key, reduction, row_stats, dw_fp32,
                bool(precompute_row_grad))
        else:
            rows, _, z_rows, acc, ent, *_ = _forward_op(hidden2, weight, bias, target1, None, class_weight, key,
                                                        False, False, False, row_stats, dw_fp32)
            loss, z_loss = (rows, z_rows) if scale is None else (rows.sum() * scale, z_rows.sum() * scale)
    extras = [z_loss] if return_z_loss else []
    if return_token_accuracy:
        extras.append(stats_mean(acc, valid_count, reduction))
    if return_entropy:
        extras.append(stats_mean(ent, valid_count, reduction))
    if reduction == "none":
        loss, extras = loss.view(target.shape), [e.view(target.shape) for e in extras]
    return (loss, *extras) if extras else loss
