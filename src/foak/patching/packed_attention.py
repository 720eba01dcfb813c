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
import sys
import threading
import warnings
import weakref

import torch
from torch import nn

from foak.ops import varlen_attention as _varlen
from foak.patching import globals as globals_
from foak.patching.rules import Rule, SharedAcrossCopies, Skip, Trigger, call_next

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


class _Counts:
    def __init__(self, row, previous: str):
        self.row, self.previous = row, previous
        self.packed: dict[str, int] = {}  # backend -> calls
        self.other: dict[str, int] = {}  # reason -> calls of the previous implementation

    def count(self, backend: str | None, reason: str | None = None) -> None:
        if torch.compiler.is_compiling():
            return
        if backend is not None:
            self.packed[backend] = self.packed.get(backend, 0) + 1
        else:
            self.other[reason] = self.other.get(reason, 0) + 1
        packed = sum(self.packed.values())
        text = f"foak varlen attention ran {_calls(packed)}"
        if self.packed:
            text += " (" + ", ".join(f"{b} {n}" for b, n in sorted(self.packed.items())) + ")"
        if self.other:
            reasons = ", ".join(f"{why} ({n})" for why, n in sorted(self.other.items()))
            text += f"; the previous implementation ({self.previous}) ran {_calls(sum(self.other.values()))}: {reasons}"
        self.row.note_runtime("calls", text)


def _calls(n: int) -> str:
    return f"{n} call" if n == 1 else f"{n} calls"


class _Entry(SharedAcrossCopies):
    """A patched model's packed attention: its counts and the implementation its config named before. Every
    module of the patched stack holds it (attribute ``_ENTRY_ATTR``): a model built from the same config
    object but not patched holds none, and runs the previous implementation, uncounted."""

    __slots__ = ("counts", "previous")

    def __init__(self, counts: _Counts, previous: str):
        self.counts, self.previous = counts, previous


_ENTRY_ATTR = "_foak_packed_attention"
# id(config) -> (weak config, the implementation it named before foak selected its own): for the mask
# function, which receives the config only, and for models sharing a patched model's config object
_PREVIOUS: dict[int, tuple] = {}
# the counts live as long as the report (which survives a re-patch after a deepcopy)
_COUNTS: dict[tuple[int, str], _Counts] = {}


def _previous_of(config) -> str | None:
    item = _PREVIOUS.get(id(config))
    return item[1] if item is not None and item[0]() is config else None


def _counts_of(state, rule_id: str, previous: str) -> _Counts:
    key = (id(state.report), rule_id)
    counts = _COUNTS.get(key)
    if counts is None:
        counts = _COUNTS[key] = _Counts(state.result, previous)
        weakref.finalize(state.report, _COUNTS.pop, key, None)
    counts.row, counts.previous = state.result, previous
    return counts


def packed_attention_counts(report, rule_id: str) -> tuple[dict[str, int], dict[str, int]]:
    """({backend: packed calls foak ran}, {reason: calls the previous implementation ran}) of a report's row."""
    counts = _COUNTS.get((id(report), rule_id))
    return ({}, {}) if counts is None else (dict(counts.packed), dict(counts.other))


# ---- the batch: packed or not, decided once per forward ---------------------------------------------


class _Forward:
    __slots__ = ("config", "entry", "position_ids", "seqs")

    def __init__(self, config, entry, position_ids, seqs):
        self.config, self.entry, self.position_ids, self.seqs = config, entry, position_ids, seqs


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
        out = _previous_function(module, entry.previous)(module, query, key, value, attention_mask, *args, **kwargs)
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
    if isinstance(seqs, _AtRunTime):
        out = _varlen.varlen_attention_by_positions(q, k, v, position_ids, scale=kwargs.get("scaling"), window=window,
                                                    backend=backend)
    else:
        out = _varlen.varlen_attention(q, k, v, seqs, scale=kwargs.get("scaling"), window=window, backend=backend)
    entry.counts.count(backend)
    return out.reshape(B, S, Hq, value.shape[3]), None


def foak_attention_mask(**kwargs):
    """transformers' attention-mask-function signature (keyword arguments). No mask for the packed batch of
    a patched stack's forward; otherwise exactly the previous implementation's mask."""
    config = kwargs.get("config")
    current = _CURRENT.forward
    if current is not None and current.config is config:
        if (current.seqs is not None and kwargs.get("attention_mask") is None
                and kwargs.get("batch_size") == current.seqs.batch
                and kwargs.get("q_length") == current.seqs.seq_len == kwargs.get("kv_length")):
            return None
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
        entry = _Entry(_counts_of(state, rule_id, previous), previous)
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
        read_blocks = _argument_reader(original, image_blocks) if image_blocks else None
        row, with_images = state.result, [0]

        def forward(self, *args, **kwargs):
            position_ids = read_ids(args, kwargs)
            seqs = None
            # attention dropout in training: the packed path has none, so the batch keeps transformers' mask
            # and the previous implementation (counted as "attention dropout")
            config = config_of(self)
            dropout = self.training and float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0
            blocks = read_blocks(args, kwargs) if read_blocks is not None else None
            if isinstance(blocks, torch.Tensor) and (torch.compiler.is_compiling() or bool(blocks.ne(0).any())):
                # bidirectional image blocks: transformers' mask (and the previous implementation) for this batch
                if not torch.compiler.is_compiling():
                    with_images[0] += 1
                    n = with_images[0]
                    row.note_runtime("images", f"{n} forward{'s' if n != 1 else ''} with image tokens "
                                     f"({image_blocks}) kept transformers' mask (bidirectional image blocks)")
            elif isinstance(position_ids, torch.Tensor) and read_mask(args, kwargs) is None \
                    and position_ids.dim() == 2 and not dropout:
                source = read_input(args, kwargs)
                source = read_embeds(args, kwargs) if source is None else source
                batch = source.shape[0] if isinstance(source, torch.Tensor) else position_ids.shape[0]
                if torch.compiler.is_compiling():  # packed or not is decided when the attention op runs
                    seqs = _AtRunTime(batch, position_ids.shape[1])
                else:
                    seqs = _sequences_of(position_ids, batch)
            outer = _CURRENT.forward
            _CURRENT.forward = _Forward(config, self.__dict__[_ENTRY_ATTR], position_ids, seqs)
            try:
                return call_next(self, rule_id, *args, **kwargs)
            finally:
                _CURRENT.forward = outer

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
