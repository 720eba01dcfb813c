"""``fast_packed_attention``: packed batches (padding-free packing) attend per sequence through foak's
``varlen_attention`` (foak.ops.varlen_attention), without transformers' dense block-causal mask.

What transformers does (5.x, sdpa and eager): when ``position_ids`` restart inside a row, no 2-D
attention_mask is given and no KV cache is used, ``masking_utils.find_packed_sequence_indices`` finds the
sequences and ``create_causal_mask`` builds a dense [B, 1, S, S] block-causal mask. SDPA then leaves its
flash kernel and its GQA path (``use_gqa_in_sdpa`` needs no mask): K/V are repeated to every head and saved
so for the backward. With a KV cache (``use_cache=True``) transformers' sdpa path does not look for packing
at all, and packed sequences attend to each other.

What this rule does: it registers an attention function and an attention-mask function named ``"foak"`` in
transformers' attention interfaces (``ALL_ATTENTION_FUNCTIONS`` / ``ALL_MASK_ATTENTION_FUNCTIONS``, while a
patched model selects them) and selects ``"foak"`` on the model's config (``config._attn_implementation``,
while a patched model uses that config object; ``foak.restore`` puts the previous name back). Every module of
the patched stack is tagged: a model built from the same config object that foak did not patch runs the
previous implementation exactly, uncounted. The decoder stack's forward (``<Arch>Model``) is wrapped to read the batch's ``position_ids``
once: a batch is packed when no attention_mask is given and the position ids restart inside a row (the
sequences are the ones transformers finds). Then

- the mask function returns no mask (nothing [S, S] is built), and
- each attention layer runs ``varlen_attention`` on the flattened q/k/v (K/V keep their heads; Mistral's /
  Qwen's ``sliding_window`` is passed on), with the sequence boundaries computed once per batch.

Every other call goes to the implementation the config named before (``sdpa`` or ``eager``), with the same
arguments, so unpacked batches compute exactly what they did (bit for bit); the report row counts the calls
of both with the reasons. Unlike transformers' sdpa path, and like its flash-attention path, a packed batch
with a KV cache is still computed per sequence. Calls the packed path does not take (attention dropout in
training, an attention-logit softcap, ``output_attentions``, positional extra arguments, a cache that holds
earlier tokens) run the previous implementation and are counted. A model whose config sets an
attention-logit softcap (Gemma 2's ``attn_logit_softcapping``) is left alone, and its row says so.
GPTBigCode's attention receives no position_ids: it has no rule.

Sliding-window layers of UNPACKED batches (Mistral's ``sliding_window``, ``layer_types`` holding
``sliding_attention``: Qwen2/3, Gemma's local layers): transformers builds a dense [B, 1, S, S] sliding-window
mask for them (``create_sliding_window_causal_mask``, which calls the mask function with
``local_size=config.sliding_window``, in 5.17 as in 5.24), and SDPA leaves its flash kernel. The stack's forward
also decides, once per batch, whether its sliding-window layers run foak's path (:class:`_WindowBatch`): no
attention mask (each row one sequence; no host read), or a 2-D padding mask whose tokens are one run per row
(left or right padding: one host read of the mask, the tokens gathered to varlen sequences and the output
scattered back, zeros at the padded positions as SDPA leaves a query that sees no key). Then the mask function
returns None for the plain sliding-window mask (no overlay, no offsets, the batch's own size), and every layer
called with ``sliding_window`` and no mask runs ``varlen_attention`` with the window. Full-attention layers get
transformers' mask and the previous implementation as before (bit-identical). Whether the window covers the
whole sequence or not, the path is the same (then it is plain causal attention, as flash computes it). A call
it cannot take (positional arguments, output_attentions, softcap, sinks not given as ``s_aux``, dropout, a cache
with earlier tokens) gets transformers' sliding-window mask after all (built from the arguments the mask function
recorded, once per forward) and the previous implementation, counted with the reason. Whole batches that keep
transformers' mask, counted per sliding-window call: a softcap in the model (Gemma2), attention dropout in
training, a cache holding earlier tokens, a padding mask with gaps, left padding under ``eager`` (eager's mask
makes a padding position's softmax uniform over the whole row, and the usual shifted labels read that
position's output), a prepared 4-D mask, and torch.compile (no host read while tracing; not counted: compiled
calls never are).

Attention sinks (gpt-oss: a learned logit per head, ``module.sinks``, that transformers passes as ``s_aux``)
are ``varlen_attention``'s ``sinks``: packed batches run as above, and since such a model's previous
implementation is ``eager`` (scores [B, H, S, S]), its unpacked batches run EVERY layer through varlen attention,
the full-attention layers too (their plain causal mask is not built either: ``_WindowBatch.full``). Left padding
is taken under eager then: with a sink, eager's softmax of a query that sees no token puts all its weight on the
sink (output zeros, as foak's). Under torch.compile a model with sinks keeps transformers' masks and eager (the
op that reads the position ids at run time takes no sinks). transformers' own gpt-oss does not keep packed
sequences apart (its masks are built without the position ids); foak does, as transformers' flash path does.
On CUDA the sinks path (foak's flash kernel with the sink folded into its log-sum-exp) has not been checked on a
GPU yet: a batch of such a model on CUDA keeps transformers' masks and attention (each forward counted in the
row) unless ``FOAK_CUDA_SINKS=1``.

A layer recomputed in the backward (gradient checkpointing, reentrant or not) finds its batch through the
position ids it receives (each such forward gets ids of its own, copied if given; see ``_WINDOWS``).

Models whose config names another implementation are left alone and say why in the row:
``flash_attention_*`` already run packed batches per sequence (varlen from position_ids), ``flex_attention``
keeps them apart with its block mask.

Under torch.compile the position ids cannot be read while dynamo traces (a host read is a graph break): a
stack forward given position ids and no attention mask then sends every attention layer to
``varlen_attention_by_positions`` (foak.ops.varlen_attention), a custom op that finds the sequences when it
runs (a batch in which no row restarts is one sequence per row) and whose backward recomputes the attention
forward. Calls that run compiled are not counted in the report row.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import warnings
import weakref

import torch
from torch import nn

from foak.ops import varlen_attention as _varlen
from foak.patching import globals as globals_
from foak.patching.rules import CallCounts, Rule, SharedAcrossCopies, Skip, Trigger, call_next

IMPLEMENTATION = "foak"  # the name registered in transformers' attention and attention-mask interfaces
TAKEN_OVER = ("sdpa", "eager")  # the implementations that build the dense block-causal mask


def _hf():
    """(ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS), or None where transformers lacks them."""
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return None
    return ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS


# ---- call counts (what really ran), shown in the rule's report row ----------------------------------


class _Counts(CallCounts):
    def __init__(self, row, previous: str):
        super().__init__(row)
        self.previous = previous
        self.packed: dict[str, int] = {}  # backend -> calls
        self.windowed: dict[str, int] = {}  # backend -> calls of sliding-window layers on unpacked batches
        self.full: dict[str, int] = {}  # backend -> calls of full-attention layers on unpacked batches (sinks)
        self.sinks = 0  # calls of foak's varlen attention with attention sinks (of any of the above)
        self.other: dict[str, int] = {}  # reason -> calls of the previous implementation

    def count(self, backend: str | None, reason: str | None = None, windowed: bool = False, full: bool = False,
              sinks: bool = False) -> None:
        if not self.counting():
            return
        if backend is not None:
            self.bump(self.full if full else self.windowed if windowed else self.packed, backend)
            self.sinks += bool(sinks)
        else:
            self.bump(self.other, reason)
        packed = sum(self.packed.values())
        text = f"foak varlen attention ran {_calls(packed)}"
        if self.packed:
            text += " (" + ", ".join(f"{b} {n}" for b, n in sorted(self.packed.items())) + ")"
        if self.windowed:
            text += (f"; sliding-window layers of unpacked batches: foak varlen attention ran "
                     f"{_calls(sum(self.windowed.values()))} ("
                     + ", ".join(f"{b} {n}" for b, n in sorted(self.windowed.items())) + ")")
        if self.full:
            text += (f"; full-attention layers of unpacked batches: foak varlen attention ran "
                     f"{_calls(sum(self.full.values()))} ("
                     + ", ".join(f"{b} {n}" for b, n in sorted(self.full.items())) + ")")
        if self.sinks:
            text += f"; {_calls(self.sinks)} with attention sinks"
        if self.other:
            reasons = ", ".join(f"{why} ({n})" for why, n in sorted(self.other.items()))
            text += f"; the previous implementation ({self.previous}) ran {_calls(sum(self.other.values()))}: {reasons}"
        self.show(text)


def _forwards(n: int) -> str:
    return f"{n} forward" if n == 1 else f"{n} forwards"


def _calls(n: int) -> str:
    return f"{n} call" if n == 1 else f"{n} calls"


class _Entry(SharedAcrossCopies):
    """A patched model's packed attention: its counts and the implementation its config named before. Every
    module of the patched stack holds it (attribute ``_ENTRY_ATTR``): a model built from the same config
    object but not patched holds none, and runs the previous implementation, uncounted."""

    __slots__ = ("counts", "cudnn", "previous")

    def __init__(self, counts: _Counts, previous: str, cudnn: bool = False):
        self.counts, self.previous, self.cudnn = counts, previous, cudnn


_ENTRY_ATTR = "_foak_packed_attention"
CUDA_SINKS_ENV = "FOAK_CUDA_SINKS"  # "1": attention sinks through foak's flash kernel on CUDA (not yet GPU-checked)
CUDNN_ATTR = "_foak_cudnn_attention"  # set on the model by foak.patch (the cudnn_attention switch)
_CUDNN_FIRST = None  # the SDPA backend priority with cuDNN's attention first (built on first use)


def _cudnn_declines(query, key, value, attention_mask, kwargs) -> str | None:
    """Why an unpacked call going to SDPA does not ask for cuDNN's attention first; None: it does, and cuDNN
    takes it (torch.backends.cuda.can_use_cudnn_attention on the call's tensors)."""
    if not query.is_cuda:
        return "not on CUDA"
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"{str(query.dtype).replace('torch.', '')} q/k/v (cuDNN attention: fp16/bf16)"
    if torch.cuda.get_device_capability(query.device)[0] < 9:
        return "a GPU before sm90 (measured on Hopper only)"
    if attention_mask is not None:
        return "a mask"
    if kwargs.get("dropout") or kwargs.get("dropout_p"):
        return "dropout"
    if torch.compiler.is_compiling():
        return "compiling"
    gqa = key.shape[1] != query.shape[1]
    params = torch.backends.cuda.SDPAParams(query, key, value, None, 0.0, query.shape[2] > 1, gqa)
    if not torch.backends.cuda.can_use_cudnn_attention(params):
        return "cuDNN's checks" + (" (grouped K/V heads)" if gqa else "")
    return None


def _sdpa_cudnn_first():
    global _CUDNN_FIRST
    if _CUDNN_FIRST is None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]
        _CUDNN_FIRST = lambda: sdpa_kernel(order, set_priority=True)  # noqa: E731
    return _CUDNN_FIRST()


# id(config) -> (weak config, the implementation it named before foak selected its own): for the mask
# function, which receives the config only, and for models sharing a patched model's config object
_PREVIOUS: dict[int, tuple] = {}


def _previous_of(config) -> str | None:
    item = _PREVIOUS.get(id(config))
    return item[1] if item is not None and item[0]() is config else None


def _counts_of(state, rule_id: str, previous: str) -> _Counts:
    counts = _Counts.of(state, rule_id, previous)
    counts.previous = previous
    return counts


def packed_attention_counts(report, rule_id: str) -> tuple[dict[str, int], dict[str, int]]:
    """({backend: packed calls foak ran}, {reason: calls the previous implementation ran}) of a report's row."""
    counts = _Counts.find(report, rule_id)
    return ({}, {}) if counts is None else (dict(counts.packed), dict(counts.other))


def sink_attention_counts(report, rule_id: str) -> tuple[int, dict[str, int]]:
    """(calls of foak's varlen attention with attention sinks, {backend: calls of full-attention layers of
    unpacked batches}) of a report's row: a model with sinks (gpt-oss) runs every layer of an unpacked batch
    through foak's varlen attention."""
    counts = _Counts.find(report, rule_id)
    return (0, {}) if counts is None else (counts.sinks, dict(counts.full))


def window_attention_counts(report, rule_id: str) -> dict[str, int]:
    """{backend: calls of sliding-window layers on unpacked batches that foak's varlen attention ran} of a
    report's row (the calls of the previous implementation are in :func:`packed_attention_counts`)."""
    counts = _Counts.find(report, rule_id)
    return {} if counts is None else dict(counts.windowed)


# ---- the batch: packed or not, decided once per forward ---------------------------------------------


class _Forward:
    __slots__ = ("config", "entry", "position_ids", "seqs", "window", "window_reason")

    def __init__(self, config, entry, position_ids, seqs, window=None, window_reason=None):
        self.config, self.entry, self.position_ids, self.seqs = config, entry, position_ids, seqs
        # the batch as the sliding-window layers see it (_WindowBatch), or why they keep transformers' mask
        self.window, self.window_reason = window, window_reason


class _Current(threading.local):
    def __init__(self):
        self.forward: _Forward | None = None


_CURRENT = _Current()  # the patched decoder stack running in this thread, if any


class _AtRunTime:
    """The seqs of a stack's forward that torch.compile traces: the position ids cannot be read while tracing,
    so the attention layers call the custom op that finds the sequences when it runs
    (foak.ops.varlen_attention.varlen_attention_by_positions)."""

    __slots__ = ("batch", "seq_len")

    def __init__(self, batch: int, seq_len: int):
        self.batch, self.seq_len = batch, seq_len

    @property
    def total(self) -> int:
        return self.batch * self.seq_len


def _remember(position_ids: torch.Tensor, batch: int, seqs) -> None:
    # a checkpointed layer recomputed in the backward, outside the stack's forward, finds its batch again
    _varlen.remember_sequences(position_ids, batch, seqs)


def _sequences_of(position_ids: torch.Tensor, batch: int):
    return _varlen.sequences_of(position_ids, batch) if position_ids.dim() == 2 else None


# ---- sliding-window layers of unpacked batches ----------------------------------------------------------
# A batch that is not packed (no attention mask, or a 2-D padding mask: left or right padding) is decided once
# per stack forward. Then the mask function returns no mask for transformers' sliding-window mask
# (``create_sliding_window_causal_mask`` calls it with ``local_size=config.sliding_window``) and every layer
# called with ``sliding_window`` and no mask runs varlen_attention on the batch's tokens (gathered from a
# padded batch, its output scattered back: zeros at the padded positions). The masks of the full-attention
# layers are built as before and those layers run the previous implementation, unchanged.
#
# A layer recomputed in the backward (gradient checkpointing) runs outside the stack's forward: it finds its
# batch again through the position_ids it receives (the same tensor, or a detached alias of it under
# reentrant checkpointing: same storage and version counter), kept in _WINDOWS. Each forward gets position
# ids of its own (transformers makes them when none are given; given ones are copied), so two batches never
# share them.


class _WindowBatch:
    """An unpacked batch as its sliding-window layers see it: ``seqs`` (varlen sequences of its tokens),
    ``index`` (flat positions of the tokens of a padded batch, None when no row has padding), ``has_mask``
    (a 2-D mask was given), the keyword arguments transformers' sliding-window mask was asked with (to build
    that mask after all for a call foak's path declines) and ``mask_reason`` (why a sliding-window mask was
    built anyway)."""

    __slots__ = ("batch", "seq_len", "seqs", "index", "has_mask", "mask_kwargs", "mask_reason", "ids", "_mask",
                 "full", "full_kwargs")

    def __init__(self, batch, seq_len, seqs, index, has_mask, full=False):
        self.batch, self.seq_len, self.seqs, self.index, self.has_mask = batch, seq_len, seqs, index, has_mask
        self.mask_kwargs = self.mask_reason = self.ids = None
        self._mask = {}
        # attention sinks (gpt-oss): the full-attention layers take the path too (their plain causal mask is
        # not built; full_kwargs: what transformers asked the mask function for, to build it for a declined call)
        self.full, self.full_kwargs = full, None

    def previous_mask(self, previous: str, full: bool = False):
        """transformers' sliding-window (or, ``full``, causal) mask for this batch (built once per forward, for
        a declined call)."""
        key = (previous, full)
        if key not in self._mask:
            self._mask[key] = _hf()[1][previous](**(self.full_kwargs if full else self.mask_kwargs))
        return self._mask[key]


_WINDOWS: dict[tuple, tuple] = {}  # (device, data_ptr, shape) of position ids -> (the ids, their version, batch)
_WINDOWS_SIZE = 64  # forwards whose layers may still be recomputed; the ids are held, so no address is reused


def _remember_window(position_ids: torch.Tensor, window: _WindowBatch | None) -> None:
    key = (str(position_ids.device), position_ids.data_ptr(), tuple(position_ids.shape))
    _WINDOWS.pop(key, None)
    _WINDOWS[key] = (position_ids, position_ids._version, window)
    while len(_WINDOWS) > _WINDOWS_SIZE:
        try:
            _WINDOWS.pop(next(iter(_WINDOWS)), None)
        except (StopIteration, RuntimeError):
            break


_UNKNOWN = object()


def _recalled_window(position_ids) -> _WindowBatch | None | object:
    """The _WindowBatch (or None: not one) remembered for these position ids, _UNKNOWN when none is."""
    if not isinstance(position_ids, torch.Tensor) or torch.compiler.is_compiling():
        return _UNKNOWN
    item = _WINDOWS.get((str(position_ids.device), position_ids.data_ptr(), tuple(position_ids.shape)))
    if item is None or item[1] != position_ids._version:
        return _UNKNOWN
    return item[2]


def _window_of_config(config) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return None
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and "sliding_attention" not in layer_types:
        return None
    return window


def _window_batch(config, declines: str | None, mask, past, source, position_ids, dropout: bool, previous: str,
                  full: bool = False):
    """(_WindowBatch, None) for an unpacked batch whose sliding-window layers foak computes, else (None, why
    not; None where the model has no sliding-window layer). ``config``: the one the attention layers read (a
    multimodal model's text config). ``full`` (a model with attention sinks): its full-attention layers too."""
    if _window_of_config(config) is None and not full:
        return None, None
    if declines is not None:
        return None, declines
    if torch.compiler.is_compiling():  # reading a padding mask would be a graph break; not counted while compiled
        return None, "torch.compile"
    if not getattr(config, "is_causal", True):
        return None, "non-causal attention"
    if dropout:
        return None, "attention dropout"
    if not isinstance(source, torch.Tensor) or source.dim() < 2:
        return None, "no input_ids or inputs_embeds"
    if position_ids is not None and (not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2):
        return None, "position_ids that are not [batch, seq_len]"
    if past is not None:
        try:
            seen = int(past.get_seq_length())
        except Exception:  # noqa: BLE001 - a cache foak does not know: keep transformers' mask
            return None, "a KV cache foak cannot read"
        if seen:
            return None, "a KV cache holding earlier tokens"
    batch, seq_len = source.shape[0], source.shape[1]
    if mask is None:
        seqs, index = _varlen.rows_as_sequences(batch, seq_len, source.device), None
    elif not isinstance(mask, torch.Tensor) or mask.dim() != 2 or tuple(mask.shape) != (batch, seq_len):
        return None, "an attention mask that is not a [batch, seq_len] padding mask"
    else:
        host = mask.detach().to("cpu")  # the one host read of the batch
        found = _varlen.unpadded_sequences(host, device=source.device)
        if found is None:
            return None, "a padding mask that is not left or right padding"
        seqs, index = found
        # (with attention sinks, eager's softmax of such a position puts all its weight on the sink: zeros too)
        if index is not None and previous == "eager" and not full and not bool((host[:, 0] != 0).all()):
            # transformers' eager mask adds finfo.min to every score of a position before a row's first token:
            # a uniform softmax over the whole row, whose output (and its gradient) the loss sees where the last
            # such position predicts the first token; SDPA, and foak, leave zeros there
            return None, "left padding under eager attention"
    return _WindowBatch(batch, seq_len, seqs, index, mask is not None, full), None


def _plain_sliding_mask(kwargs, window: _WindowBatch) -> str | None:
    """None when the mask function was asked for transformers' plain sliding-window causal mask (with padding
    at most) of ``window``'s batch, else why foak builds it as before. Not a sliding-window mask: ''."""
    config = kwargs.get("config")
    local = kwargs.get("local_size")
    if local is None or local != _window_of_config(config) or local == getattr(config, "attention_chunk_size", None):
        return ""
    if kwargs.get("use_vmap") or kwargs.get("allow_is_causal_skip") is False:
        return "a sliding-window mask with extra patterns"
    if (kwargs.get("batch_size") != window.batch or kwargs.get("q_length") != window.seq_len
            or kwargs.get("kv_length") != window.seq_len):
        return "a sliding-window mask of another size than the batch"
    if any(not isinstance(kwargs.get(k, 0), int) or kwargs.get(k, 0) != 0 for k in ("q_offset", "kv_offset")):
        return "a sliding-window mask with offsets"
    if (kwargs.get("attention_mask") is not None) != window.has_mask:
        return "a sliding-window mask of another padding than the batch"
    return None


def _plain_full_mask(kwargs, window: _WindowBatch) -> str | None:
    """None when the mask function was asked for transformers' plain causal mask (with padding at most) of
    ``window``'s batch (whose full-attention layers foak computes: attention sinks), else why foak builds it."""
    if kwargs.get("local_size") is not None:
        return "a chunked or local mask"
    if kwargs.get("use_vmap") or kwargs.get("allow_is_causal_skip") is False:
        return "a causal mask with extra patterns"
    if (kwargs.get("batch_size") != window.batch or kwargs.get("q_length") != window.seq_len
            or kwargs.get("kv_length") != window.seq_len):
        return "a causal mask of another size than the batch"
    if any(not isinstance(kwargs.get(k, 0), int) or kwargs.get(k, 0) != 0 for k in ("q_offset", "kv_offset")):
        return "a causal mask with offsets"
    if (kwargs.get("attention_mask") is not None) != window.has_mask:
        return "a causal mask of another padding than the batch"
    return None


def _sinks_of(module, query, kwargs):
    """(the call's attention sinks or None, why the varlen path declines them or None)."""
    sinks = kwargs.get("s_aux")
    if sinks is None:
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            return None, "attention sinks not passed to the attention function (s_aux)"
        return None, None
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or sinks.shape[0] != query.shape[1] \
            or not sinks.is_floating_point() or sinks.device != query.device:
        return None, "attention sinks (s_aux) that are not one logit per query head"
    return sinks, None


def _why_not_window(module, query, key, args, kwargs, window: _WindowBatch, position_ids) -> str | None:
    if args:
        return "positional arguments after the attention mask"
    if key.shape[2] != query.shape[2]:
        return "a KV cache holding earlier tokens"
    if query.shape[0] != window.batch or query.shape[2] != window.seq_len:
        return "a query of another shape than the batch"
    if kwargs.get("dropout"):
        return "attention dropout"
    if kwargs.get("softcap") is not None:
        return "an attention-logit softcap"
    why = _sinks_of(module, query, kwargs)[1]
    if why is not None:
        return why
    if kwargs.get("output_attentions"):
        return "output_attentions"
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        return "non-causal attention"
    sliding = kwargs.get("sliding_window")
    if sliding is None and window.full:  # a full-attention layer of a model with attention sinks
        return None if isinstance(position_ids, torch.Tensor) else "no position_ids reach the attention layer"
    if not isinstance(sliding, int) or isinstance(sliding, bool) or sliding < 1:
        return "a sliding window that is not a positive int"
    if sliding != window.mask_kwargs.get("local_size"):  # the window transformers' mask would have cut
        return "a sliding window other than the config's"
    if not isinstance(position_ids, torch.Tensor):
        return "no position_ids reach the attention layer"
    return None


def _window_attention(module, entry, window: _WindowBatch, query, key, value, args, kwargs):
    """A sliding-window layer's call on an unpacked batch whose mask function built no mask."""
    reason = _why_not_window(module, query, key, args, kwargs, window, kwargs.get("position_ids"))
    full = kwargs.get("sliding_window") is None
    if reason is not None:  # transformers' sliding-window (or causal) mask after all, and the previous implementation
        mask = window.previous_mask(entry.previous, full)
        out = _previous_function(module, entry.previous)(module, query, key, value, mask, *args, **kwargs)
        entry.counts.count(None, reason)
        return out
    B, Hq, S, D = query.shape
    Dv = value.shape[3]
    q = query.transpose(1, 2).reshape(B * S, Hq, D)
    k = key.transpose(1, 2).reshape(B * S, key.shape[1], D)
    v = value.transpose(1, 2).reshape(B * S, value.shape[1], Dv)
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if window.index is not None:  # the tokens of a padded batch
        q, k, v = (t.index_select(0, window.index) for t in (q, k, v))
    backend = _varlen.resolve_backend(q, v)
    sinks = kwargs.get("s_aux")
    out = _varlen.varlen_attention(q, k, v, window.seqs, scale=kwargs.get("scaling"),
                                   window=kwargs["sliding_window"], backend=backend, sinks=sinks)
    if window.index is not None:  # zeros at the padded positions, as SDPA leaves a query that sees no key
        out = out.new_zeros((B * S, Hq, Dv)).index_copy(0, window.index, out)
    entry.counts.count(backend, windowed=True, full=full, sinks=sinks is not None)
    return out.reshape(B, S, Hq, Dv), None


# ---- the functions transformers dispatches to ---------------------------------------------------------


def _previous_function(module: nn.Module, previous: str):
    if previous == "eager":
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise RuntimeError(f"foak packed attention: {type(module).__module__} has no eager_attention_forward "
                               "to run for the previous implementation 'eager'")
        return fn
    return _hf()[0][previous]


_warned_unpatched = [False]


def _why_not_packed(module, query, key, attention_mask, args, kwargs, seqs) -> str | None:
    if seqs is None:
        return "attention dropout" if kwargs.get("dropout") else "not a packed batch"
    if attention_mask is not None:
        return "a packed batch with an attention mask"
    if args:
        return "positional arguments after the attention mask"
    if key.shape[2] != query.shape[2]:
        return "a KV cache holding earlier tokens"
    if query.shape[0] * query.shape[2] != seqs.total or query.shape[2] != seqs.seq_len:
        return "position_ids of another shape than the query"
    if kwargs.get("dropout"):
        return "attention dropout"
    if kwargs.get("softcap") is not None:
        return "an attention-logit softcap"
    why = _sinks_of(module, query, kwargs)[1]
    if why is not None:
        return why
    if kwargs.get("output_attentions"):
        return "output_attentions"
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        return "non-causal attention"
    return None


def foak_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask, *args, **kwargs):
    """transformers' attention-function signature (query/key/value [B, H, S, D]; returns [B, S, Hq, D] and
    no attention weights)."""
    entry = getattr(module, "__dict__", {}).get(_ENTRY_ATTR)
    if entry is None:
        previous = _previous_of(getattr(module, "config", None))
        if previous is not None:  # a model sharing a patched model's config object: as before, uncounted
            return _previous_function(module, previous)(module, query, key, value, attention_mask, *args, **kwargs)
        if not _warned_unpatched[0]:
            _warned_unpatched[0] = True
            warnings.warn("config._attn_implementation is 'foak' on a model foak.patch did not patch: it runs "
                          "transformers' sdpa (select foak's packed attention with foak.patch(model, "
                          "fast_packed_attention=True))", stacklevel=3)
        return _hf()[0]["sdpa"](module, query, key, value, attention_mask, *args, **kwargs)
    position_ids = kwargs.get("position_ids")
    current = _CURRENT.forward
    # a full-attention layer of a model with attention sinks: its unpacked batches take the window path too
    full = kwargs.get("sliding_window") is None and isinstance(getattr(module, "sinks", None), torch.Tensor)
    if attention_mask is None and (kwargs.get("sliding_window") is not None or full):
        window = _window_call_of(entry, current, position_ids, query.shape[0], query.shape[2],
                                 kwargs.get("sliding_window"), full)
        if window is not None:
            return _window_attention(module, entry, window, query, key, value, args, kwargs)
    if current is not None and current.entry is entry:
        seqs = current.seqs
        if position_ids is None and seqs is not None:  # the mask function built no mask for this batch
            raise RuntimeError(f"foak packed attention: {type(module).__name__} received no position_ids in a "
                               "packed batch; this architecture cannot use fast_packed_attention")
        if isinstance(seqs, _AtRunTime):  # compiling: the op reads whichever ids this layer received
            pass
        elif position_ids is not None and position_ids is not current.position_ids and seqs is not None:
            seqs = _sequences_of(position_ids, query.shape[0])  # not the stack's own ids: read them
        elif isinstance(position_ids, torch.Tensor) and not torch.compiler.is_compiling():
            _remember(position_ids, query.shape[0], seqs)
    elif isinstance(position_ids, torch.Tensor) and not torch.compiler.is_compiling():
        seqs = _sequences_of(position_ids, query.shape[0])
    else:  # compiling outside a patched stack's forward: the mask function built the previous mask
        seqs = None
    reason = _why_not_packed(module, query, key, attention_mask, args, kwargs, seqs)
    if reason is not None and seqs is not None and attention_mask is None:
        # the mask function built no mask for this packed batch: the previous implementation would let its
        # sequences attend to each other
        raise RuntimeError(f"foak fast_packed_attention: a packed batch reached {type(module).__name__} with "
                           f"{reason}, which foak's packed path does not compute and which needs transformers' "
                           "block-causal mask; disable fast_packed_attention for this model")
    if reason is not None:
        if (reason == "not a packed batch" and (kwargs.get("sliding_window") is not None or full)
                and current is not None and current.entry is entry):  # why it keeps transformers' mask
            reason = (current.window.mask_reason if current.window is not None else current.window_reason) or reason
        previous = _previous_function(module, entry.previous)
        if entry.cudnn and entry.previous == "sdpa" and reason == "not a packed batch":
            declined = _cudnn_declines(query, key, value, attention_mask, kwargs)
            if declined is None:
                with _sdpa_cudnn_first():
                    out = previous(module, query, key, value, attention_mask, *args, **kwargs)
                entry.counts.count(None, "not a packed batch: sdpa with cuDNN attention")
                return out
            reason = f"not a packed batch: sdpa without cuDNN attention ({declined})"
        out = previous(module, query, key, value, attention_mask, *args, **kwargs)
        entry.counts.count(None, reason)
        return out
    B, Hq, S, D = query.shape
    # views when the memory is laid out [B, S, H, D] (as HF's projections and RoPE leave it), else one copy
    q = query.transpose(1, 2).reshape(B * S, Hq, D)
    k = key.transpose(1, 2).reshape(B * S, key.shape[1], key.shape[3])
    v = value.transpose(1, 2).reshape(B * S, value.shape[1], value.shape[3])
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):  # what SDPA does under autocast (fp32 q/k after HF's RoPE)
        dtype = torch.get_autocast_dtype(device_type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    backend = _varlen.resolve_backend(q, v)
    window = kwargs.get("sliding_window")
    sinks = kwargs.get("s_aux")
    if isinstance(seqs, _AtRunTime):  # (a stack with attention sinks never compiles this path: see its forward)
        out = _varlen.varlen_attention_by_positions(q, k, v, position_ids, scale=kwargs.get("scaling"), window=window,
                                                    backend=backend)
    else:
        out = _varlen.varlen_attention(q, k, v, seqs, scale=kwargs.get("scaling"), window=window, backend=backend,
                                       sinks=sinks)
    entry.counts.count(backend, sinks=sinks is not None)
    return out.reshape(B, S, Hq, value.shape[3]), None


def _window_call_of(entry, current, position_ids, batch: int, seq_len: int, sliding, full: bool = False):
    """The _WindowBatch a sliding-window layer's call without a mask computes (``full``: a full-attention layer
    of a model with attention sinks), or None (no mask from transformers itself: the previous implementation)."""
    if current is not None and current.entry is entry:
        window = current.window
        if window is None or (window.full_kwargs if full else window.mask_kwargs) is None:
            return None  # the mask function was not asked for its window (causal) mask
        if isinstance(position_ids, torch.Tensor) and position_ids is not window.ids and \
                not torch.compiler.is_compiling():
            window.ids = position_ids  # found again by a layer recomputed in the backward
            _remember_window(position_ids, window)
        return window
    window = _recalled_window(position_ids)  # a layer recomputed in the backward (gradient checkpointing)
    if window is not _UNKNOWN:
        return window
    # (eager always gets a causal mask from transformers: a full-attention layer without one was foak's batch)
    short = full and seq_len > 1 and entry.previous == "eager" or isinstance(sliding, int) and seq_len >= sliding
    if short and not torch.compiler.is_compiling() \
            and not (isinstance(position_ids, torch.Tensor) and _sequences_of(position_ids, batch) is not None):
        # transformers never leaves a window this short without a mask: it was foak's batch, now forgotten
        raise RuntimeError("foak packed attention: a sliding-window layer recomputed outside its stack's forward "
                           "cannot find its batch (no position_ids reach the attention, or more than "
                           f"{_WINDOWS_SIZE} forwards before its backward)")
    return None


def foak_attention_mask(**kwargs):
    """transformers' attention-mask-function signature (keyword arguments). No mask for the packed batch of
    a patched stack's forward, nor for the sliding-window mask of its unpacked batch (see _WindowBatch);
    otherwise exactly the previous implementation's mask."""
    config = kwargs.get("config")
    current = _CURRENT.forward
    if current is not None and current.config is config:
        if (current.seqs is not None and kwargs.get("attention_mask") is None
                and kwargs.get("batch_size") == current.seqs.batch
                and kwargs.get("q_length") == current.seqs.seq_len == kwargs.get("kv_length")):
            return None
        window = current.window
        if window is not None:
            why = _plain_sliding_mask(kwargs, window)
            if why == "" and window.full:  # not a sliding-window mask: the causal one, with attention sinks
                why = _plain_full_mask(kwargs, window)
                if why is None:
                    if window.full_kwargs is None:
                        window.full_kwargs = dict(kwargs)
                    return None
            if why is None:
                if window.mask_kwargs is None:
                    window.mask_kwargs = dict(kwargs)
                return None
            if why:
                window.mask_reason = why
        previous = current.entry.previous
    else:
        previous = _previous_of(config) or "sdpa"
    return _hf()[1][previous](**kwargs)


def _install():
    attention, masks = _hf()
    undo = [globals_.register_in(attention, IMPLEMENTATION, foak_attention_forward),
            globals_.register_in(masks, IMPLEMENTATION, foak_attention_mask)]
    return lambda: [fn() for fn in undo]


def is_registered() -> bool:
    """Whether transformers' attention interface currently knows foak's packed attention."""
    hf = _hf()
    return hf is not None and type(hf[0])._global_mapping.get(IMPLEMENTATION) is foak_attention_forward


def _implementation_attribute(config) -> str:
    # transformers 5.x: a property over _attn_implementation_internal whose setter also writes every
    # sub-config; foak sets (and restores) the one config the modules read
    if isinstance(getattr(type(config), "_attn_implementation", None), property) and \
            "_attn_implementation_internal" in vars(config):
        return "_attn_implementation_internal"
    return "_attn_implementation"


_NOT_TAKEN = {
    "flash_attention_2": "it computes packed batches per sequence itself (varlen from position_ids)",
    "flash_attention_3": "it computes packed batches per sequence itself (varlen from position_ids)",
    "flash_attention_4": "it computes packed batches per sequence itself (varlen from position_ids)",
    "flex_attention": "its block mask keeps packed sequences apart without a dense mask",
}


def _argument_reader(forward, name: str):
    """A function (args, kwargs) -> the value of argument ``name`` of ``forward``'s call (None if absent)."""
    try:
        names = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        names = []
    index = names.index(name) if name in names else None

    def read(args, kwargs):
        if name in kwargs:
            return kwargs[name]
        return args[index] if index is not None and index < len(args) else None

    return read


def _argument_writer(forward, name: str):
    """A function (args, kwargs, value) -> (args, kwargs) with argument ``name`` of ``forward``'s call set."""
    try:
        names = list(inspect.signature(forward).parameters)
    except (TypeError, ValueError):
        names = []
    index = names.index(name) if name in names else None

    def write(args, kwargs, value):
        if index is not None and index < len(args) and name not in kwargs:
            args = (*args[:index], value, *args[index + 1:])
        else:
            kwargs = {**kwargs, name: value}
        return args, kwargs

    return write


def packed_attention_rule(arch: str, stack_class: type, text_config: bool = False,
                          image_blocks: str | None = None) -> Rule:
    """The ``fast_packed_attention`` rule of a decoder whose stack (``<Arch>Model``) is ``stack_class``. With
    ``text_config``, ``stack_class`` is a multimodal model (e.g. Gemma3Model) that builds its text tower's
    masks itself from ``config.get_text_config()``, which the text tower's attention layers read.
    ``image_blocks``: the forward argument (e.g. ``token_type_ids``) whose non-zero entries mark image tokens
    that attend to each other both ways: a batch with any keeps transformers' mask (counted in the row)."""
    config_of = (lambda m: m.config.get_text_config()) if text_config else (lambda m: m.config)
    rule_id = f"{arch}.packed_attention"

    def skip_reason(model):
        if _hf() is None:
            return "this transformers has no attention-mask interface (transformers.masking_utils)"
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if getattr(config, "attn_logit_softcapping", None):  # Gemma 2
            return ("attn_logit_softcapping: foak's varlen attention has no attention-logit softcap; transformers' "
                    "attention and block-causal mask run")
        return None

    def patch(module, model, state):
        # gpt-oss: a learned sink logit per head (a parameter of each attention module, passed as s_aux) joins
        # the softmax: varlen_attention's sinks. Such a model runs every layer of its unpacked batches (full
        # attention too) through varlen attention: its previous implementation is eager, [B, H, S, S] scores
        with_sinks = any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in module.modules())
        config = config_of(module)
        attribute = _implementation_attribute(config)
        previous = getattr(config, attribute, None)
        if previous == IMPLEMENTATION:  # another patched model shares this config object
            previous = _previous_of(config)
            if previous is None:
                return Skip(f"config._attn_implementation is {IMPLEMENTATION!r}, but no patched model selected it")
        if previous not in TAKEN_OVER:
            why = _NOT_TAKEN.get(previous, "foak takes over sdpa and eager only")
            return Skip(f"config._attn_implementation is {previous!r}: {why}")
        entry = _Entry(_counts_of(state, rule_id, previous), previous, bool(model.__dict__.get(CUDNN_ATTR)))
        tagged = [m for m in module.modules() if getattr(m, "config", None) is config or m is module]
        for m in tagged:
            m.__dict__[_ENTRY_ATTR] = entry
        state.on_restore(lambda: [m.__dict__.pop(_ENTRY_ATTR, None) for m in tagged])
        state.result._backend = _varlen.policy  # what runs the packed calls, read when the report is
        original = module.forward
        read_ids = _argument_reader(original, "position_ids")
        read_mask = _argument_reader(original, "attention_mask")
        read_input = _argument_reader(original, "input_ids")
        read_embeds = _argument_reader(original, "inputs_embeds")
        read_cache = _argument_reader(original, "cache")  # transformers >= 5.2x; "past_key_values" before
        read_past_key_values = _argument_reader(original, "past_key_values")

        def read_past(args, kwargs):
            past = read_cache(args, kwargs)
            return read_past_key_values(args, kwargs) if past is None else past

        write_ids = _argument_writer(original, "position_ids")
        # what keeps the sliding-window layers of every unpacked batch on transformers' mask
        declines = None
        if getattr(config, "attn_logit_softcapping", None) is not None:
            declines = "an attention-logit softcap"
        read_blocks = _argument_reader(original, image_blocks) if image_blocks else None
        row, with_images, gated = state.result, [0], [0]

        def forward(self, *args, **kwargs):
            position_ids = read_ids(args, kwargs)
            mask = read_mask(args, kwargs)
            seqs = None
            # attention dropout in training: the packed path has none, so the batch keeps transformers' mask
            # and the previous implementation (counted as "attention dropout")
            config = config_of(self)
            dropout = self.training and float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0
            source = read_input(args, kwargs)
            source = read_embeds(args, kwargs) if source is None else source
            blocks = read_blocks(args, kwargs) if read_blocks is not None else None
            images = isinstance(blocks, torch.Tensor) and (torch.compiler.is_compiling() or bool(blocks.ne(0).any()))
            sinks_gated = with_sinks and isinstance(source, torch.Tensor) and source.is_cuda and \
                os.environ.get(CUDA_SINKS_ENV) != "1"
            if sinks_gated:  # transformers' mask and attention for this batch (counted)
                if not torch.compiler.is_compiling():
                    gated[0] += 1
                    row.note_runtime("sinks gated", f"{_forwards(gated[0])} on CUDA kept transformers' attention: "
                                     f"foak's flash kernel with attention sinks awaits its GPU check "
                                     f"(benchmarks/sink_attention.py); {CUDA_SINKS_ENV}=1 runs it")
            elif images:
                # bidirectional image blocks: transformers' mask (and the previous implementation) for this batch
                if not torch.compiler.is_compiling():
                    with_images[0] += 1
                    n = with_images[0]
                    row.note_runtime("images", f"{n} forward{'s' if n != 1 else ''} with image tokens "
                                     f"({image_blocks}) kept transformers' mask (bidirectional image blocks)")
            elif isinstance(position_ids, torch.Tensor) and mask is None and position_ids.dim() == 2 and not dropout:
                batch = source.shape[0] if isinstance(source, torch.Tensor) else position_ids.shape[0]
                if torch.compiler.is_compiling():  # packed or not is decided when the attention op runs
                    # (the op that reads the ids at run time takes no sinks: transformers' mask and eager)
                    seqs = None if with_sinks else _AtRunTime(batch, position_ids.shape[1])
                else:
                    seqs = _sequences_of(position_ids, batch)
            window = reason = None
            if sinks_gated:
                reason = f"attention sinks on CUDA ({CUDA_SINKS_ENV} not set)"
            elif images:
                reason = f"image tokens ({image_blocks})"
            elif seqs is None:
                window, reason = _window_batch(config, declines, mask, read_past(args, kwargs), source, position_ids,
                                               dropout, self.__dict__[_ENTRY_ATTR].previous, with_sinks)
                if window is not None and isinstance(position_ids, torch.Tensor):
                    # ids of this forward's own, by which a recomputed layer finds its batch (see _WINDOWS)
                    position_ids = position_ids.clone()
                    args, kwargs = write_ids(args, kwargs, position_ids)
            outer = _CURRENT.forward
            _CURRENT.forward = _Forward(config, self.__dict__[_ENTRY_ATTR], position_ids, seqs, window, reason)
            try:
                return call_next(self, rule_id, *args, **kwargs)
            finally:
                _CURRENT.forward = outer
                if window is not None:
                    window._mask.clear()  # a mask built for declined calls: not kept beyond the forward

        globals_.acquire_for(module, state, "packed_attention", _install)
        # the config object may be shared by several models: selected while any patched model uses it
        globals_.acquire_for(module, state, ("attn_implementation", id(config)),
                             functools.partial(_select, config, attribute, previous))
        state.result.note_runtime("selected", f"config._attn_implementation: {previous!r} -> {IMPLEMENTATION!r}")
        return forward

    return Rule(rule_id, "packed_attention", Trigger(stack_class), patch, skip_reason)


def _select(config, attribute: str, previous: str):
    """Select foak's implementation on ``config``; returns the undo (which leaves a value set since alone)."""
    setattr(config, attribute, IMPLEMENTATION)
    _PREVIOUS[id(config)] = (weakref.ref(config), previous)

    def undo():
        if _previous_of(config) == previous:
            del _PREVIOUS[id(config)]
        if getattr(config, attribute, None) == IMPLEMENTATION:
            setattr(config, attribute, previous)

    return undo
