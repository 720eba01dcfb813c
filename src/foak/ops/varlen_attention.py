"""Causal attention over packed sequences ("varlen"): one call for a batch whose rows hold several
sequences, each attending only to itself, without a dense [S, S] mask and without repeating K/V for GQA.

foak writes no attention kernel here: each backend is an attention implementation torch ships, reached
through its own entry point, and this module only derives the sequence boundaries and holds the autograd glue.

- ``flash``: ``torch.ops.aten._flash_attention_forward`` / ``_flash_attention_backward`` with cumulative
  sequence lengths (the FlashAttention-2 kernels vendored in torch; the same entry point torch's SDPA flash
  path and ``torch.nn.attention.varlen`` use). K/V keep their own head count (the kernel maps each query
  head to its K/V head), a sliding window is the kernel's ``window_size_left``. CUDA, fp16/bf16, head dim
  <= 256.
- ``varlen_attn``: ``torch.nn.attention.varlen.varlen_attn`` (public, prototype; its keyword arguments have
  changed between torch releases, so they are read from its signature).
- ``flex``: FlexAttention with a document mask (``create_block_mask`` once per batch and window, kept on
  the :class:`PackedSequences`), compiled on CUDA. torch has no FlexAttention backward on the CPU.
- ``sdpa``: ``F.scaled_dot_product_attention`` once per sequence (``is_causal``; an explicit band mask for a
  sequence longer than the window; ``enable_gqa``). Any device and dtype: the CPU path and the fallback for
  fp32 on CUDA.

``auto`` (the default, or ``FOAK_PACKED_ATTENTION`` / :func:`set_backend`): ``flash`` for fp16/bf16 CUDA
tensors with a head dim it takes, ``sdpa`` otherwise. A forced backend that cannot serve a call is a
ValueError, never a silent switch. :func:`varlen_attention_reference` is the explicit fp32/fp64 math the
tests compare every backend with.

Attention sinks (``sinks``: one learned logit per query head, gpt-oss): each query row's softmax gets one more
key whose score is the head's sink logit and whose value is 0. From a backend's normalised output ``o`` and
its log-sum-exp ``lse`` (scaled scores), ``lse_tot = logaddexp(lse, sink)`` and ``out = o * exp(lse - lse_tot)``.
The backward is the backend's own with the final ``out`` and ``lse_tot`` in place of its ``o`` and ``lse`` (the
sink's value is 0, so dq, dk, dv are exactly those of the larger softmax), and ``d sink = -sum over rows of
rowsum(dout * out) * exp(sink - lse_tot)``. ``flash`` computes it so on CUDA; ``sdpa`` with sinks runs torch's
CPU flash entry points per sequence on the CPU (``_scaled_dot_product_flash_attention_for_cpu`` and its
backward, which give ``lse`` too) and explicit math per sequence elsewhere (fp32 on CUDA). ``varlen_attn`` and
``flex`` take no sinks (a ValueError).

Sequences are found as transformers finds them (``masking_utils.find_packed_sequence_indices``): a new
sequence starts at each row start and wherever a position id is not the previous one plus 1.
"""

from __future__ import annotations

import inspect
import math
import os
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from foak.ops._custom_op import autograd_inside_op, custom_op

BACKENDS = ("auto", "flash", "varlen_attn", "flex", "sdpa")
_forced: str | None = None


def set_backend(name: str | None) -> None:
    """Force one backend for every packed attention call; ``"auto"`` or ``None`` restores the default."""
    global _forced
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown packed-attention backend {name!r}; expected one of {BACKENDS}")
    _forced = None if name in (None, "auto") else name


def get_backend() -> str:
    """The setting: :func:`set_backend`'s value, else ``FOAK_PACKED_ATTENTION``, else ``"auto"``."""
    if _forced is not None:
        return _forced
    name = os.environ.get("FOAK_PACKED_ATTENTION", "auto") or "auto"
    if name not in BACKENDS:
        raise ValueError(f"FOAK_PACKED_ATTENTION={name!r} is not valid; expected one of {BACKENDS}")
    return name


def policy() -> str:
    """The setting in words, for the patch report."""
    name = get_backend()
    if name == "auto":
        return "auto: flash (fp16/bf16 on CUDA), per-sequence sdpa otherwise"
    return f"{name} (forced)"


# ---- sequence boundaries --------------------------------------------------------------------------------


@dataclass(eq=False)
class PackedSequences:
    """The sequences of a packed [batch, seq_len] batch, flattened to ``batch * seq_len`` tokens in row
    order: ``cu_seqlens`` (int32, on the tokens' device) holds the N + 1 boundaries, ``lengths`` and
    ``max_seqlen`` the same on the host (read once per batch)."""

    batch: int
    seq_len: int
    cu_seqlens: torch.Tensor
    lengths: tuple[int, ...]
    max_seqlen: int
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def total(self) -> int:
        return self.batch * self.seq_len

    @property
    def starts(self) -> tuple[int, ...]:
        starts = self._cache.get("starts")
        if starts is None:
            starts = self._cache["starts"] = tuple(int(x) for x in torch.tensor((0, *self.lengths)).cumsum(0)[:-1])
        return starts

    def document_ids(self) -> torch.Tensor:
        """Sequence index of each token (int32, [total], on the device), built once."""
        doc = self._cache.get("doc")
        if doc is None:
            n = len(self.lengths)
            lengths = torch.tensor(self.lengths, device=self.cu_seqlens.device)
            doc = self._cache["doc"] = torch.repeat_interleave(
                torch.arange(n, dtype=torch.int32, device=self.cu_seqlens.device), lengths)
        return doc


def packed_sequences(position_ids: torch.Tensor, batch_size: int | None = None) -> PackedSequences | None:
    """The sequences of a batch from its ``position_ids`` ([batch, seq_len], or [1, seq_len] shared by every
    row), or None when no row restarts (one sequence per row: not a packed batch). One device-to-host copy of
    the position ids."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.is_floating_point():
        raise ValueError("packed_sequences: position_ids must be an integer tensor [batch, seq_len], got "
                         f"{type(position_ids).__name__} {tuple(getattr(position_ids, 'shape', ()))}")
    rows, seq_len = position_ids.shape
    batch = rows if batch_size is None else batch_size
    if rows not in (1, batch):
        raise ValueError(f"packed_sequences: position_ids has {rows} rows for a batch of {batch}")
    host = position_ids.detach().to("cpu")
    restarts = host[:, 1:] - host[:, :-1] != 1
    if seq_len < 2 or not bool(restarts.any()):
        return None
    starts = torch.ones((rows, seq_len), dtype=torch.bool)
    starts[:, 1:] = restarts
    if rows != batch:
        starts = starts.expand(batch, seq_len)
    flat = starts.reshape(-1).nonzero().flatten()
    cu = torch.cat([flat, torch.tensor([batch * seq_len])]).to(torch.int32)
    lengths = tuple(cu.diff().tolist())
    return PackedSequences(batch, seq_len, cu.to(position_ids.device), lengths, max(lengths))


# position_ids tensors read recently -> their PackedSequences (or None): the layers of one forward, and a
# checkpointed layer recomputed in the backward, read a batch's ids once. A plain dict (insertion order = age)
# changed only by single dict operations, which are atomic: no lock on this per-call path, and any thread (the
# autograd engine runs CUDA backwards on its own threads) finds what another one stored.
_RECENT: dict[int, tuple] = {}
_RECENT_SIZE = 8


def remember_sequences(position_ids: torch.Tensor, batch: int, seqs: PackedSequences | None) -> None:
    """Record ``seqs`` as the sequences of ``position_ids`` for a batch of ``batch`` rows (see sequences_of)."""
    key = id(position_ids)
    _RECENT.pop(key, None)  # re-inserted last: the newest
    _RECENT[key] = (weakref.ref(position_ids), position_ids._version, batch, seqs)
    while len(_RECENT) > _RECENT_SIZE:
        try:
            _RECENT.pop(next(iter(_RECENT)), None)
        except (StopIteration, RuntimeError):  # emptied, or changed by another thread meanwhile
            break


def sequences_of(position_ids: torch.Tensor, batch: int | None = None) -> PackedSequences | None:
    """:func:`packed_sequences`, remembered for the last few position-id tensors: the same tensor object,
    not modified since (its version counter), for the same batch size reads nothing again."""
    batch = position_ids.shape[0] if batch is None else batch
    item = _RECENT.get(id(position_ids))
    if item is not None and item[0]() is position_ids and item[1] == position_ids._version and item[2] == batch:
        return item[3]
    seqs = packed_sequences(position_ids, batch)
    remember_sequences(position_ids, batch, seqs)
    return seqs


def rows_as_sequences(batch: int, seq_len: int, device=None) -> PackedSequences:
    """:class:`PackedSequences` of a batch that is not packed: each of the ``batch`` rows one sequence."""
    cu = torch.arange(0, batch * seq_len + 1, seq_len, dtype=torch.int32, device=device)
    return PackedSequences(batch, seq_len, cu, (seq_len,) * batch, seq_len)


def unpadded_sequences(padding_mask: torch.Tensor, device=None) -> tuple[PackedSequences, torch.Tensor | None] | None:
    """The sequences of a left- or right-padded batch from its 2-D mask ([batch, seq_len], nonzero = token): the
    tokens of each row are one sequence. Returns ``(seqs, index)``: ``index`` (int64 [T], on the mask's device)
    holds the flat positions ``row * seq_len + column`` of the T tokens in row order and ``seqs`` the sequences
    of those T tokens gathered (rows without tokens hold none); when no row has padding, ``index`` is None and
    ``seqs`` one sequence per row (:func:`rows_as_sequences`). None when a row's tokens are not one contiguous
    run (padding inside a row) or the batch holds no token. One device-to-host copy of the mask; the results are
    on ``device`` (default: the mask's)."""
    if not isinstance(padding_mask, torch.Tensor) or padding_mask.dim() != 2:
        raise ValueError("unpadded_sequences: padding_mask must be a tensor [batch, seq_len], got "
                         f"{type(padding_mask).__name__} {tuple(getattr(padding_mask, 'shape', ()))}")
    batch, seq_len = padding_mask.shape
    device = padding_mask.device if device is None else device
    host = padding_mask.detach().to("cpu") != 0
    lengths = host.sum(1)
    if bool((lengths == seq_len).all()):
        return rows_as_sequences(batch, seq_len, device), None
    first = host.to(torch.uint8).argmax(1)  # the first token of each row (0 for a row without tokens)
    column = torch.arange(seq_len)
    run = (column >= first[:, None]) & (column < (first + lengths)[:, None])
    if not torch.equal(run, host) or int(lengths.sum()) == 0:
        return None
    index = (torch.arange(batch)[:, None] * seq_len + column).masked_select(host)
    kept = tuple(int(n) for n in lengths.tolist() if n)
    seqs = sequences_from_lengths(kept, device)
    return seqs, index.to(device)


def sequences_from_lengths(lengths, device=None, batch: int = 1) -> PackedSequences:
    """:class:`PackedSequences` of ``batch`` rows holding sequences of these lengths in order (rows must
    split at sequence boundaries). For tests and benchmarks."""
    lengths = tuple(int(n) for n in lengths)
    if not lengths or min(lengths) < 1:
        raise ValueError(f"sequences_from_lengths: lengths must be >= 1, got {lengths}")
    total = sum(lengths)
    if total % batch:
        raise ValueError(f"sequences_from_lengths: {total} tokens do not split into {batch} rows")
    cu = torch.tensor((0, *lengths)).cumsum(0)
    seq_len = total // batch
    if any(int(b) * seq_len not in set(cu.tolist()) for b in range(batch)):
        raise ValueError(f"sequences_from_lengths: a sequence crosses a row boundary (rows of {seq_len})")
    return PackedSequences(batch, seq_len, cu.to(torch.int32).to(device), lengths, max(lengths))


# ---- the reference: explicit math -------------------------------------------------------------------


def varlen_attention_reference(q, k, v, seqs: PackedSequences, scale: float | None = None,
                               window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Explicit causal softmax attention per sequence in the inputs' dtype (pass fp32/fp64 copies): scores,
    a causal (and window) mask, softmax, weighted sum; K/V heads indexed per query head. ``sinks`` ([Hq]): one
    more column per query row holding the head's sink logit, dropped after the softmax. [T, Hq, D]."""
    T, Hq, D = q.shape
    group = Hq // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    outs = []
    for start, n in zip(seqs.starts, seqs.lengths):
        qs = q[start:start + n].transpose(0, 1)  # [Hq, n, D]
        ks = k[start:start + n].transpose(0, 1).repeat_interleave(group, 0)
        vs = v[start:start + n].transpose(0, 1).repeat_interleave(group, 0)
        scores = (qs @ ks.transpose(1, 2)) * scale
        i = torch.arange(n, device=q.device)
        allowed = i[:, None] >= i[None, :]
        if window is not None:
            allowed &= i[:, None] - i[None, :] < window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            column = sinks.to(scores.dtype)[:, None, None].expand(-1, n, 1)
            probs = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        outs.append((probs @ vs).transpose(0, 1))
    return torch.cat(outs)


# ---- backends -----------------------------------------------------------------------------------------


def _sdpa_per_sequence(q, k, v, seqs, scale, window):
    gqa = q.shape[1] != k.shape[1]
    masks: dict[int, torch.Tensor] = {}
    outs = []
    for start, n in zip(seqs.starts, seqs.lengths):
        qs, ks, vs = (t[start:start + n].transpose(0, 1) for t in (q, k, v))  # [H, n, D]
        if window is not None and n > window:
            mask = masks.get(n)
            if mask is None:
                i = torch.arange(n, device=q.device)
                mask = masks[n] = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=n > 1, scale=scale, enable_gqa=gqa)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


class _FlashVarlen(torch.autograd.Function):
    """aten's FlashAttention-2 varlen forward and backward (GQA and the window inside the kernel)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_seqlen, scale, window_left):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_seqlen, max_seqlen, 0.0, True, False, scale=scale,
            window_size_left=window_left, window_size_right=0 if window_left is not None else None)
        ctx.save_for_backward(q, k, v, out, lse, cu, rng_state, unused)
        ctx.max_seqlen, ctx.scale, ctx.window_left = max_seqlen, scale, window_left
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, rng_state, unused = ctx.saved_tensors
        window_left = ctx.window_left
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse, cu, cu, ctx.max_seqlen, ctx.max_seqlen, 0.0, True, rng_state,
            unused, scale=ctx.scale, window_size_left=window_left,
            window_size_right=0 if window_left is not None else None)
        return dq, dk, dv, None, None, None, None


def _flash(q, k, v, seqs, scale, window):
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    window_left = None if window is None or window >= seqs.max_seqlen else window - 1
    return _FlashVarlen.apply(q, k, v, seqs.cu_seqlens, seqs.max_seqlen, scale, window_left)


# ---- attention sinks ------------------------------------------------------------------------------------


def _sink_combine(o, lse, sinks):
    """(out, lse_tot): a backend's normalised output ``o`` [T, H, D] and its log-sum-exp ``lse`` [H, T] with
    each head's sink logit joined to every row's softmax (a key of value 0). lse_tot in fp32 (fp64 for fp64)."""
    dtype = torch.promote_types(lse.dtype, torch.float32)
    lse = lse.to(dtype)
    lse_tot = torch.logaddexp(lse, sinks.detach().to(dtype)[:, None])
    out = (o.to(dtype) * torch.exp(lse - lse_tot).t()[..., None]).to(o.dtype)
    return out, lse_tot


def _sink_grad(dout, out, lse_tot, sinks):
    """d sink_h = -sum over rows of rowsum(dout * out) * p_sink (p_sink = exp(sink - lse_tot)), [H]."""
    dtype = lse_tot.dtype
    rows = (dout.to(dtype) * out.to(dtype)).sum(-1)  # [T, H]
    p_sink = torch.exp(sinks.detach().to(dtype)[:, None] - lse_tot)  # [H, T]
    return -(rows.t() * p_sink).sum(1).to(sinks.dtype)


def _lse_per_token(lse, seqs):
    """The flash kernel's log-sum-exp as [H, T]: its varlen layout is [H, T]; older ones are [N, H, max_seqlen]."""
    if lse.dim() == 2:
        return lse
    return torch.cat([lse[i, :, :n] for i, n in enumerate(seqs.lengths)], 1)


def _lse_kernel_layout(lse_tokens, shape, seqs):
    if len(shape) == 2:
        return lse_tokens.contiguous()
    out = lse_tokens.new_zeros(shape)
    for i, (start, n) in enumerate(zip(seqs.starts, seqs.lengths)):
        out[i, :, :n] = lse_tokens[:, start:start + n]
    return out


def _aten_flash_forward(*args, **kwargs):  # a name of this module's own, which the tests replace on the CPU
    return torch.ops.aten._flash_attention_forward(*args, **kwargs)


def _aten_flash_backward(*args, **kwargs):
    return torch.ops.aten._flash_attention_backward(*args, **kwargs)


class _FlashVarlenSinks(torch.autograd.Function):
    """aten's FlashAttention-2 varlen forward/backward with a sink logit per head joined to every softmax row."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, seqs, scale, window_left):
        cu = seqs.cu_seqlens
        o, lse, rng_state, unused, _ = _aten_flash_forward(
            q, k, v, cu, cu, seqs.max_seqlen, seqs.max_seqlen, 0.0, True, False, scale=scale,
            window_size_left=window_left, window_size_right=0 if window_left is not None else None)
        out, lse_tot = _sink_combine(o, _lse_per_token(lse, seqs), sinks)
        ctx.save_for_backward(q, k, v, sinks, out, lse_tot, rng_state, unused)
        ctx.seqs, ctx.scale, ctx.window_left, ctx.lse_shape = seqs, scale, window_left, tuple(lse.shape)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks, out, lse_tot, rng_state, unused = ctx.saved_tensors
        seqs, window_left = ctx.seqs, ctx.window_left
        dout = dout.contiguous()
        cu = seqs.cu_seqlens
        dq, dk, dv = _aten_flash_backward(
            dout, q, k, v, out, _lse_kernel_layout(lse_tot, ctx.lse_shape, seqs), cu, cu, seqs.max_seqlen,
            seqs.max_seqlen, 0.0, True, rng_state, unused, scale=ctx.scale, window_size_left=window_left,
            window_size_right=0 if window_left is not None else None)
        dsinks = _sink_grad(dout, out, lse_tot, sinks) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None, None, None


def _flash_sinks(q, k, v, seqs, scale, window, sinks):
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    window_left = None if window is None or window >= seqs.max_seqlen else window - 1
    return _FlashVarlenSinks.apply(q, k, v, sinks, seqs, scale, window_left)


def _band_mask(n, window, like):
    """None (plain causal) or the additive causal band mask of a sequence longer than the window."""
    if window is None or n <= window:
        return None
    i = torch.arange(n, device=like.device)
    allowed = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
    return torch.zeros((n, n), dtype=like.dtype, device=like.device).masked_fill(~allowed, float("-inf"))


def _heads_first(t, start, n, group):
    """[1, H * group, n, D] (contiguous) of one sequence's tokens; K/V repeated to the query heads."""
    t = t[start:start + n].transpose(0, 1)
    if group > 1:
        t = t.repeat_interleave(group, 0)
    return t.contiguous()[None]


class _CpuFlashSinks(torch.autograd.Function):
    """torch's CPU flash attention (which returns the log-sum-exp) once per sequence, with sinks."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, seqs, scale, window):
        group = q.shape[1] // k.shape[1]
        outs, lses = [], []
        for start, n in zip(seqs.starts, seqs.lengths):
            qs, ks, vs = (_heads_first(t, start, n, g) for t, g in ((q, 1), (k, group), (v, group)))
            mask = _band_mask(n, window, q)
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qs, ks, vs, 0.0, mask is None, attn_mask=mask, scale=scale)
            outs.append(o[0].transpose(0, 1))
            lses.append(lse[0])
        out, lse_tot = _sink_combine(torch.cat(outs), torch.cat(lses, 1), sinks)
        ctx.save_for_backward(q, k, v, sinks, out, lse_tot)
        ctx.seqs, ctx.scale, ctx.window = seqs, scale, window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, sinks, out, lse_tot = ctx.saved_tensors
        seqs, window = ctx.seqs, ctx.window
        Hkv = k.shape[1]
        group = q.shape[1] // Hkv
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for start, n in zip(seqs.starts, seqs.lengths):
            qs, ks, vs = (_heads_first(t, start, n, g) for t, g in ((q, 1), (k, group), (v, group)))
            dos, os_ = (_heads_first(t, start, n, 1) for t in (dout, out))
            mask = _band_mask(n, window, q)
            g_q, g_k, g_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dos, qs, ks, vs, os_, lse_tot[None, :, start:start + n].contiguous(), 0.0, mask is None,
                attn_mask=mask, scale=ctx.scale)
            dq[start:start + n] = g_q[0].transpose(0, 1)
            dk[start:start + n] = g_k[0].reshape(Hkv, group, n, -1).sum(1).transpose(0, 1)
            dv[start:start + n] = g_v[0].reshape(Hkv, group, n, -1).sum(1).transpose(0, 1)
        dsinks = _sink_grad(dout, out, lse_tot, sinks) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsinks, None, None, None


def _sdpa_sinks(q, k, v, seqs, scale, window, sinks):
    if q.device.type == "cpu":
        return _CpuFlashSinks.apply(q, k, v, sinks, seqs, scale, window)
    return _math_sinks(q, k, v, seqs, scale, window, sinks)


def _math_sinks(q, k, v, seqs, scale, window, sinks):
    """Explicit fp32 math per sequence ([H, n, n + 1] scores at a time), under autograd: the path of sinks for
    tensors the flash kernels do not take off the CPU (fp32 on CUDA)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    out = varlen_attention_reference(q.to(dtype), k.to(dtype), v.to(dtype), seqs, scale, window, sinks)
    return out.to(q.dtype)


_SINK_IMPLEMENTATIONS = {"flash": _flash_sinks, "sdpa": _sdpa_sinks}


def _varlen_attn(q, k, v, seqs, scale, window):
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kwargs = {"scale": scale}
    if "window_size" in params:
        kwargs["window_size"] = (-1 if window is None or window >= seqs.max_seqlen else window - 1, 0)
    elif window is not None and window < seqs.max_seqlen:
        raise ValueError("varlen_attention: this torch's varlen_attn takes no window_size (sliding window); use "
                         "backend 'flash', 'flex' or 'sdpa'")
    else:
        kwargs["is_causal"] = True
    if q.shape[1] != k.shape[1] and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    cu = seqs.cu_seqlens
    return varlen_attn(q, k, v, cu, cu, seqs.max_seqlen, seqs.max_seqlen, **kwargs)


_compiled_flex = None


def _flex(q, k, v, seqs, scale, window):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _compiled_flex
    if q.requires_grad and q.device.type == "cpu":
        raise ValueError("varlen_attention: torch has no FlexAttention backward on the CPU; use backend 'sdpa'")
    key = ("block_mask", window, str(q.device))
    block_mask = seqs._cache.get(key)
    if block_mask is None:
        doc = seqs.document_ids().to(q.device)
        w = window

        def document_causal(b, h, q_idx, kv_idx):
            keep = (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
            return keep if w is None else keep & (q_idx - kv_idx < w)

        extra = {"_compile": True} if "_compile" in inspect.signature(create_block_mask).parameters and \
            q.is_cuda else {}
        block_mask = seqs._cache[key] = create_block_mask(document_causal, None, None, seqs.total, seqs.total,
                                                          device=q.device, **extra)
    fn = flex_attention
    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    out = fn(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=block_mask,
             scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)


_IMPLEMENTATIONS = {"flash": _flash, "varlen_attn": _varlen_attn, "flex": _flex, "sdpa": _sdpa_per_sequence}


def _flash_serves(q, v) -> str | None:
    """None when aten's flash kernel takes these tensors, else why not."""
    if not q.is_cuda:
        return f"tensors on {q.device.type} (flash needs CUDA)"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{str(q.dtype).removeprefix('torch.')} tensors (flash takes fp16/bf16)"
    if q.shape[-1] > 256 or q.shape[-1] % 8 or v.shape[-1] != q.shape[-1]:
        return f"head dim {q.shape[-1]} (flash takes a multiple of 8 up to 256, the same for V)"
    return None


def resolve_backend(q: torch.Tensor, v: torch.Tensor, backend: str | None = None) -> str:
    """The backend that runs a call on these tensors: ``backend`` (default: :func:`get_backend`) with
    ``auto`` resolved. A forced backend that cannot take them is a ValueError."""
    name = get_backend() if backend is None else backend
    if name not in BACKENDS:
        raise ValueError(f"unknown packed-attention backend {name!r}; expected one of {BACKENDS}")
    if name == "auto":
        return "flash" if _flash_serves(q, v) is None else "sdpa"
    if name in ("flash", "varlen_attn"):
        why = _flash_serves(q, v)
        if why is not None:
            raise ValueError(f"packed-attention backend {name!r} cannot run {why}; use 'auto' or 'sdpa'")
    return name


def _check_qkv(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or not t.is_floating_point():
            raise ValueError(f"varlen_attention: {name} must be a floating tensor [tokens, heads, head_dim], got "
                             f"{type(t).__name__} {tuple(getattr(t, 'shape', ()))}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(f"varlen_attention: q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} "
                         f"on {q.device}/{k.device}/{v.device}")
    if k.shape[:2] != v.shape[:2] or k.shape[0] != q.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"varlen_attention: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "do not fit (same tokens; k and v the same heads; q and k the same head dim)")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"varlen_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} K/V heads")


def _check_window(window) -> None:
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"varlen_attention: window must be a positive int or None, got {window!r}")


def _check_sinks(sinks, q) -> None:
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or sinks.shape[0] != q.shape[1] or \
            not sinks.is_floating_point() or sinks.device != q.device:
        raise ValueError(f"varlen_attention: sinks must be a floating tensor [{q.shape[1]}] (one logit per query "
                         f"head) on {q.device}, got {type(sinks).__name__} {tuple(getattr(sinks, 'shape', ()))}"
                         + (f" on {sinks.device}" if isinstance(sinks, torch.Tensor) else ""))


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: PackedSequences, *,
                     scale: float | None = None, window: int | None = None, backend: str | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of every packed sequence with itself only.

    ``q``: [T, Hq, D]; ``k``, ``v``: [T, Hkv, D] (Hq a multiple of Hkv: GQA, K/V never repeated by foak), T =
    ``seqs.total`` tokens in row order. ``scale``: default 1/sqrt(D). ``window``: a token attends to itself
    and the ``window - 1`` before it (transformers' ``sliding_window``), None for none. ``backend``: see the
    module docstring (default: the setting). ``sinks``: [Hq] attention-sink logits (gpt-oss; see the module
    docstring), backends ``flash`` and ``sdpa`` only. Returns [T, Hq, D] in q's dtype; differentiable in q, k, v
    (and sinks)."""
    _check_qkv(q, k, v)
    if q.shape[0] != seqs.total:
        raise ValueError(f"varlen_attention: {q.shape[0]} tokens, but the sequences hold {seqs.total}")
    _check_window(window)
    _check_sinks(sinks, q)
    name = resolve_backend(q, v, backend)
    if sinks is not None:
        if name not in _SINK_IMPLEMENTATIONS:
            raise ValueError(f"varlen_attention: backend {name!r} takes no attention sinks; use 'auto', 'flash' "
                             "or 'sdpa'")
        return _SINK_IMPLEMENTATIONS[name](q, k, v, seqs, scale, window, sinks)
    return _IMPLEMENTATIONS[name](q, k, v, seqs, scale, window)


# ---- the sequences read at run time: one custom op, for torch.compile --------------------------------
# While torch.compile traces, the sequence boundaries cannot be read (a host read of the position ids is a
# graph break, and the per-sequence loops depend on the values). These ops take the position ids instead and
# find the sequences when they run (one host read per batch, remembered as above); a batch in which no row
# restarts is one sequence per row. The backward recomputes the attention forward under autograd (one more
# attention forward) instead of keeping backend-specific state from the forward.


def _sequences_at_run_time(q: torch.Tensor, position_ids: torch.Tensor) -> PackedSequences:
    seq_len = position_ids.shape[1]
    batch = q.shape[0] // seq_len
    seqs = sequences_of(position_ids, batch)
    return rows_as_sequences(batch, seq_len, q.device) if seqs is None else seqs


def _by_positions_fake(q, k, v, position_ids, scale, window, backend):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


@custom_op("varlen_attention", _by_positions_fake)
def _by_positions_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor,
                     scale: float | None, window: int | None, backend: str) -> torch.Tensor:
    seqs = _sequences_at_run_time(q, position_ids)
    with torch.no_grad():
        return _IMPLEMENTATIONS[backend](q, k, v, seqs, scale, window).contiguous()


def _by_positions_backward_fake(dout, q, k, v, position_ids, scale, window, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the op returns


@custom_op("varlen_attention_backward", _by_positions_backward_fake)
def _by_positions_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              position_ids: torch.Tensor, scale: float | None, window: int | None, backend: str
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seqs = _sequences_at_run_time(q, position_ids)
    with autograd_inside_op():
        q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
        out = _IMPLEMENTATIONS[backend](q_, k_, v_, seqs, scale, window)
        dq, dk, dv = torch.autograd.grad(out, (q_, k_, v_), dout)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


class _VarlenByPositions(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, position_ids, scale, window, backend):
        ctx.save_for_backward(q, k, v, position_ids)
        ctx.scale, ctx.window, ctx.backend = scale, window, backend
        return _by_positions_op(q, k, v, position_ids, scale, window, backend)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, position_ids = ctx.saved_tensors
        dq, dk, dv = _by_positions_backward_op(dout.contiguous(), q, k, v, position_ids, ctx.scale, ctx.window,
                                               ctx.backend)
        return dq, dk, dv, None, None, None, None


def varlen_attention_by_positions(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, position_ids: torch.Tensor, *,
                                  scale: float | None = None, window: int | None = None,
                                  backend: str | None = None) -> torch.Tensor:
    """:func:`varlen_attention` with the sequences found from ``position_ids`` ([rows, seq_len], rows 1 or the
    batch, T = batch * seq_len tokens) when the op runs, inside the custom ops ``torch.ops.foak.varlen_attention``
    / ``varlen_attention_backward``: the form torch.compile traces without a graph break. A batch in which no
    row restarts is one causal sequence per row. The backward recomputes the attention forward."""
    _check_qkv(q, k, v)
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.is_floating_point():
        raise ValueError("varlen_attention_by_positions: position_ids must be an integer tensor [rows, seq_len], got "
                         f"{type(position_ids).__name__} {tuple(getattr(position_ids, 'shape', ()))}")
    rows, seq_len = position_ids.shape
    if seq_len == 0 or q.shape[0] % seq_len or rows not in (1, q.shape[0] // seq_len):
        raise ValueError(f"varlen_attention_by_positions: {q.shape[0]} tokens do not fit position_ids of shape "
                         f"{tuple(position_ids.shape)} (tokens = batch * seq_len, rows 1 or the batch)")
    _check_window(window)
    name = resolve_backend(q, v, backend)
    return _VarlenByPositions.apply(q, k, v, position_ids.to(q.device), scale, window, name)
