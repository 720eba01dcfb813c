"""Linear layer + cross-entropy (the LM head and its loss) without materialising the [N, V] logits.

``linear_cross_entropy(hidden, weight, target, bias=None, shift=False, **loss_options)`` equals
``cross_entropy(hidden @ weight.T + bias, target, **loss_options)`` (see ``ops/cross_entropy.py`` for the
options). Rows are processed in chunks sized to a fixed memory budget; rows whose target is ignored are
skipped entirely (no GEMM work). ``shift=True`` takes hidden ``[B, S, H]`` and unshifted labels
``[B, S]`` and predicts token ``s + 1`` from position ``s`` by shifting the labels, never the hidden states.
"""

from __future__ import annotations

import torch

from foak.backend import use_triton
from foak.ops._checks import check_float_tensor, check_same_device, check_same_dtype
from foak.ops._custom_op import custom_op
from foak.ops.cross_entropy import (
    _check_targets,
    ce_launch,
    check_loss_options,
    cross_entropy_reference,
    loss_options,
    reduction_scale,
    scale_unless_one_,
)


# 1. reference -------------------------------------------------------------------------------------
def shift_labels(target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """[B, S] labels -> labels for "position s predicts token s + 1" (last position ignored)."""
    return torch.nn.functional.pad(target[..., 1:], (0, 1), value=ignore_index)


def linear_cross_entropy_reference(hidden, weight, target, bias=None, shift=False, ignore_index=-100, **loss_options):
    """Materialises the logits in fp32 (ground truth for tests)."""
    if shift:
        target = shift_labels(target, ignore_index)
    logits = hidden.reshape(-1, hidden.shape[-1]).float() @ weight.float().t()
    if bias is not None:
        logits = logits + bias.float()
    return cross_entropy_reference(logits, target.reshape(-1), ignore_index=ignore_index, **loss_options)


# 2-3. kernels and launchers: the row kernel of ops/cross_entropy.py runs on each chunk of logits ----
# Rows per chunk: the [rows, V] logits chunk (which then holds its own gradient) stays under chunk_bytes.
# Launch knobs, swept on the GPU by benchmarks/tune_ops.py; chunk_rows overrides the budget (tests).
# At hidden [8192, 4096] x weight [128256, 4096] bf16 on the H200, fwd+bwd took 41.8 / 39.7 / 37.5 / 35.5 ms
# with 96 / 112 / 128 / 192 MiB chunks: larger chunks mean fewer read-modify-write passes over the weight
# gradient. 112 MiB keeps the whole extra memory (chunk + gathered rows) under 128 MiB.
TUNING = {"chunk_bytes": 112 * 2**20, "chunk_rows": None}


def _rows_per_chunk(n_classes: int, element_size: int, chunk_bytes: int | None = None) -> int:
    if TUNING["chunk_rows"]:
        return int(TUNING["chunk_rows"])
    return max(16, (chunk_bytes or TUNING["chunk_bytes"]) // (n_classes * element_size) // 16 * 16)


def _chunked_pass(hidden, weight, bias, target, valid_rows, options, dloss, lse=None, want=(True, True, True)):
    """One pass over the non-ignored rows, chunk by chunk: logits = h W^T (+ b), the row kernel turns them
    into loss terms and (in place) into d loss / d logits times ``dloss``, and GEMMs fold that into the
    gradients of hidden, weight and bias. ``lse`` given: a reduction="none" backward (gradients only).
    Returns (loss, lse, z_loss) per valid row (None when ``lse`` was given) and (dh, dw, db)."""
    want_dh, want_dw, want_db = want
    options = dict(options)
    chunk_bytes = options.pop("chunk_bytes", None)
    n_valid = valid_rows.numel()
    forward = lse is None
    f32 = dict(dtype=torch.float32, device=hidden.device)
    if forward:
        loss, lse, z_loss = torch.empty(n_valid, **f32), torch.empty(n_valid, **f32), torch.empty(n_valid, **f32)
    dh = torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device) if want_dh else None
    # the first chunk's GEMM writes dw (no zero fill, no read of zeros); later chunks accumulate into it
    dw = (torch.empty_like(weight) if n_valid else torch.zeros_like(weight)) if want_dw else None
    db = torch.zeros(weight.shape[0], **f32) if want_db else None
    write_grad = want_dh or want_dw or want_db
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
                        lse=None if forward else lse[start:end], **options)
        if forward:
            loss[start:end], lse[start:end], z_loss[start:end] = out
        if want_dh:
            dh.index_copy_(0, rows, torch.mm(logits, weight, out=dh_buf[: end - start]))
        if want_dw:
            if start == 0:
                torch.mm(logits.t(), h, out=dw)
            else:
                dw.addmm_(logits.t(), h)
        if want_db:
            db += logits.sum(0, dtype=torch.float32)
    stats = (loss, lse, z_loss) if forward else None
    return stats, (dh, dw, db)


def _valid_rows(target, ignore_index):
    # one host sync per call: it lets ignored rows (prompt tokens, padding) skip all GEMM work
    return (target != ignore_index).nonzero().squeeze(1)


def _scatter_rows(values, valid_rows, n_rows):
    return values.new_zeros(n_rows).index_copy_(0, valid_rows, values)


# 4. custom ops and autograd -----------------------------------------------------------------------
def _forward_fake(hidden, weight, bias, target, scale, options_key, want_dh, want_dw, want_db):
    n, f32 = hidden.shape[0], dict(dtype=torch.float32)
    rows = hidden.new_empty(n, **f32)
    empty = hidden.new_empty(0)
    return (rows, rows.new_empty(n), rows.new_empty(n),
            hidden.new_empty(hidden.shape) if want_dh else empty,
            weight.new_empty(weight.shape) if want_dw else empty,
            weight.new_empty(weight.shape[0], **f32) if want_db else empty)


@custom_op("linear_cross_entropy_forward", _forward_fake)
def _forward_op(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
    scale: torch.Tensor | None, options_key: str, want_dh: bool, want_dw: bool, want_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row loss, lse and z-loss ([N], 0 where ignored) and, when scale is given, the gradients
    (times scale) of hidden, weight and bias (empty tensors where not wanted)."""
    options = _decode(options_key)
    valid = _valid_rows(target, options["ignore_index"])
    dloss = scale if scale is not None else torch.ones((), dtype=torch.float32, device=hidden.device)
    want = (want_dh, want_dw, want_db) if scale is not None else (False, False, False)
    (loss, lse, z_loss), grads = _chunked_pass(hidden, weight, bias, target, valid, options, dloss, want=want)
    n = hidden.shape[0]
    empty = hidden.new_empty(0)
    return (_scatter_rows(loss, valid, n), _scatter_rows(lse, valid, n), _scatter_rows(z_loss, valid, n),
            *(g if g is not None else empty for g in grads))


def _backward_fake(dloss, hidden, weight, bias, target, lse, options_key, want_dh, want_dw, want_db):
    empty = hidden.new_empty(0)
    return (hidden.new_empty(hidden.shape) if want_dh else empty,
            weight.new_empty(weight.shape) if want_dw else empty,
            weight.new_empty(weight.shape[0], dtype=torch.float32) if want_db else empty)


@custom_op("linear_cross_entropy_backward", _backward_fake)
def _backward_op(
    dloss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    target: torch.Tensor, lse: torch.Tensor, options_key: str, want_dh: bool, want_dw: bool, want_db: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reduction="none" backward: gradients for the per-row incoming gradients ``dloss [N]``."""
    options = _decode(options_key)
    valid = _valid_rows(target, options["ignore_index"])
    _, grads = _chunked_pass(hidden, weight, bias, target, valid, options, dloss.float().index_select(0, valid),
                             lse=lse.index_select(0, valid), want=(want_dh, want_dw, want_db))
    empty = hidden.new_empty(0)
    return tuple(g if g is not None else empty for g in grads)


_OPTION_NAMES = ("ignore_index", "label_smoothing", "lse_square_scale", "logits_scaling", "softcap", "chunk_bytes")


def _encode(options: dict) -> str:
    # custom-op schemas take no dicts: the loss options travel as one string
    return repr(tuple(options[k] for k in _OPTION_NAMES))


def _decode(key: str) -> dict:
    import ast

    return dict(zip(_OPTION_NAMES, ast.literal_eval(key)))


class _LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, scale, options_key):
        # scale: device scalar for mean/sum (gradients are computed now), None for reduction="none"
        want = tuple(ctx.needs_input_grad[:3])
        ctx.want, ctx.options_key, ctx.used = want, options_key, False
        ctx.bias_dtype = bias.dtype if bias is not None else None
        loss, lse, z_loss, dh, dw, db = _forward_op(hidden, weight, bias, target, scale, options_key, *want)
        if scale is None:
            ctx.save_for_backward(hidden, weight, bias, target, lse)
            ctx.mark_non_differentiable(z_loss)
            return loss, z_loss
        ctx.grads = (dh, dw, db)
        total, z_total = loss.sum() * scale, z_loss.sum() * scale
        ctx.mark_non_differentiable(z_total)
        return total, z_total

    @staticmethod
    def backward(ctx, dloss, _dz):
        if not hasattr(ctx, "grads"):  # reduction="none": one more chunked pass with the per-row gradients
            hidden, weight, bias, target, lse = ctx.saved_tensors
            grads = _backward_op(dloss.contiguous(), hidden, weight, bias, target, lse, ctx.options_key, *ctx.want)
        else:
            if ctx.used:
                raise RuntimeError(
                    "linear_cross_entropy: backward ran twice through a mean/sum loss; its gradients are "
                    "computed in the forward and consumed by the first backward. Use reduction='none' with "
                    "retain_graph."
                )
            ctx.used = True
            grads = tuple(scale_unless_one_(g, dloss.float()) if g.numel() else g for g in ctx.grads)
            ctx.grads = None
        dh, dw, db = (g if want and g.numel() else None for g, want in zip(grads, ctx.want))
        if db is not None:
            db = db.to(ctx.bias_dtype)
        return dh, dw, db, None, None, None


# 5. public function -------------------------------------------------------------------------------
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
    return_z_loss: bool = False,
    chunk_bytes: int | None = None,
):
    """``cross_entropy(hidden @ weight.T + bias, target, ...)`` without the [N, V] logits.

    hidden ``[..., H]`` and target ``[...]`` (with ``shift=True``: hidden ``[B, S, H]`` and the unshifted
    labels ``[B, S]``); weight ``[V, H]`` (may be tied to an embedding); bias ``[V]`` or None. Gradients:
    hidden, weight (fp32 accumulation inside each chunk's GEMM, across chunks in the weight's dtype) and bias
    (fp32). With reduction="none" the result has target's shape.

    ``chunk_bytes`` bounds the [rows, V] logits chunk (default ``TUNING["chunk_bytes"]``, 112 MiB): larger
    chunks mean fewer passes over the weight gradient (faster) for more transient memory.
    """
    op = "linear_cross_entropy"
    check_float_tensor(op, "hidden", hidden)
    check_float_tensor(op, "weight", weight)
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
    if chunk_bytes is not None and (not isinstance(chunk_bytes, int) or chunk_bytes <= 0):
        raise ValueError(f"{op}: chunk_bytes must be a positive int (bytes of one logits chunk), got {chunk_bytes!r}")
    options = loss_options(ignore_index, label_smoothing, lse_square_scale, logits_scaling, softcap)
    if not use_triton(hidden.device):
        return linear_cross_entropy_reference(hidden, weight, target, bias, reduction=reduction,
                                              num_items_in_batch=num_items_in_batch, return_z_loss=return_z_loss,
                                              **options)
    hidden2 = hidden.reshape(-1, hidden.shape[-1])
    target1 = target.reshape(-1)
    key = _encode({**options, "chunk_bytes": chunk_bytes})
    if reduction == "none":
        scale = None
    else:
        scale = reduction_scale((target1 != ignore_index).sum(), reduction, num_items_in_batch, hidden.device)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if needs_grad:
        loss, z_loss = _LinearCrossEntropyFunction.apply(hidden2, weight, bias, target1, scale, key)
    else:
        rows, _, z_rows, *_ = _forward_op(hidden2, weight, bias, target1, None, key, False, False, False)
        loss, z_loss = (rows, z_rows) if scale is None else (rows.sum() * scale, z_rows.sum() * scale)
    if reduction == "none":
        loss, z_loss = loss.view(target.shape), z_loss.view(target.shape)
    return (loss, z_loss) if return_z_loss else loss
