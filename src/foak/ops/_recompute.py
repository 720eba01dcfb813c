"""Saving a cheap-to-recompute op output as its recipe instead of its memory.

An RMSNorm output ``y`` is saved for the backward by the projections that read it (q/k/v, gate/up), yet
it is one elementwise pass away from tensors the norm's own backward keeps anyway (x, weight, rstd).
Ops offer such outputs with :func:`offer`; while :func:`recomputing_outputs` is active (foak's patch
rules enter it around a decoder stack's forward), autograd's saved-tensor hook stores a small handle for
any saved tensor that lives in an offered output's memory. In the backward the first node that needs it
recomputes ``y`` (bit-identical: the same kernel on the same inputs) and the other nodes that saved it
share that copy, which is dropped after the last of them.

Nesting: activation checkpointing installs its own saved-tensor hooks, which take precedence inside a
checkpointed region, so the two compose. Saved-tensor hooks that are already active when the scope is
entered (``torch.autograd.graph.save_on_cpu``, TRL's activation offloading, a checkpoint around the whole
model) would be hidden by ours, since only the innermost hook sees a saved tensor: then the scope steps
aside and installs nothing, so those hooks see every tensor (``recomputing_outputs().stepped_aside``
says why). Under torch.compile the scope does nothing (the compiler plans recomputation itself).

Safety: the version counters of the recipe's inputs are checked when recomputing, and an offered output
modified in place before it was saved is saved normally; an in-place change after it was saved is what
autograd itself would refuse, and is detected while the output is still alive when the scope exits.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch

_state = threading.local()


def _active() -> dict | None:
    return getattr(_state, "offers", None)


class _Recipe:
    __slots__ = ("cache", "inputs", "output", "pending", "recompute", "version", "versions")

    def __init__(self, output, recompute, inputs):
        self.output = weakref.ref(output)
        self.version = output._version
        self.recompute = recompute
        # weakly until a consumer saves the output as this recipe (:meth:`hold`): an offered output nobody
        # saves must not keep its inputs alive for the rest of the scope. Under activation checkpointing
        # that would keep every checkpointed layer's norm input until the decoder stack returns.
        self.inputs = tuple(weakref.ref(t) for t in inputs)
        self.versions = [t._version for t in inputs]
        self.cache = None
        self.pending = 0  # saved handles not unpacked yet

    def hold(self) -> bool:
        """Keep the inputs from now on (a consumer saved the output as this recipe); False when one of them
        is gone already (then the output is saved as itself)."""
        if self.inputs and isinstance(self.inputs[0], weakref.ref):
            inputs = tuple(ref() for ref in self.inputs)
            if any(t is None for t in inputs):
                return False
            self.inputs = inputs
        return True

    def value(self) -> torch.Tensor:
        if self.cache is None:
            if [t._version for t in self.inputs] != self.versions:
                raise RuntimeError(
                    "foak: an input of a recomputed activation (an RMSNorm's x or weight) was modified in place "
                    "between the forward and the backward; the output cannot be recomputed. Disable foak's "
                    "rms_norm switch for this model or avoid the in-place update.")
            with torch.no_grad():
                self.cache = self.recompute(*self.inputs)
        return self.cache


class _Saved:
    __slots__ = ("recipe", "geometry")

    def __init__(self, recipe, t):
        self.recipe = recipe
        self.geometry = (t.shape, t.stride(), t.storage_offset())


def offer(output: torch.Tensor, recompute: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> None:
    """Let autograd save ``output`` as ``recompute(*inputs)`` (which must return the same values in a
    fresh tensor of the same dtype and layout) while a :func:`recomputing_outputs` scope is active."""
    if torch.compiler.is_compiling():  # first: nothing else is read while dynamo traces
        return
    offers = _active()
    if offers is None or not torch.is_grad_enabled():
        return
    if output.numel() == 0 or not output.is_contiguous():
        return
    ptr = output.untyped_storage().data_ptr()
    offers[ptr] = _Recipe(output, recompute, inputs)


class _Plain:
    """A tensor saved as itself, with its version: autograd skips its own in-place check for tensors saved through
    hooks, so the unpack makes it (an in-place backward that overwrote a saved activation, then a second backward
    through the retained graph, must fail, not compute from the overwritten values)."""

    __slots__ = ("tensor", "version")

    def __init__(self, t):
        self.tensor, self.version = t, t._version


def _pack(t: torch.Tensor):
    offers = _active()
    recipe = offers.get(t.untyped_storage().data_ptr()) if offers and t.numel() else None
    if recipe is None:
        return _Plain(t)
    output = recipe.output()
    if (output is None or output.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
            or output.dtype != t.dtype or output._version != recipe.version or not recipe.hold()):
        return _Plain(t)  # a stale entry, or modified in place since it was computed: save it normally
    recipe.pending += 1
    return _Saved(recipe, t)


def _unpack(saved):
    if isinstance(saved, _Plain):
        t = saved.tensor
        if t._version != saved.version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{t.dtype} {list(t.shape)}] is at version {t._version}; expected version {saved.version} instead "
                "(saved in a decoder layer patched by foak; a second backward through a retained graph after foak's "
                "in-place backward of the gated MLP is refused: patch without fast_swiglu to run one)")
        return t
    recipe = saved.recipe
    value = recipe.value()
    recipe.pending -= 1
    if recipe.pending <= 0:
        recipe.cache = None  # the last node that saved it has it now
    shape, stride, offset = saved.geometry
    return value.as_strided(shape, stride, offset)


def _top_hooks_accessor():
    """torch's reader of the innermost default saved-tensor hooks (a private API: torch >= 2.8 has
    ``_top_saved_tensors_default_hooks(ignore_is_tracing)``), or None."""
    return getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def outer_hooks_reason() -> str | None:
    """Why the scope must not install its hooks here, or None when nothing is in the way."""
    enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    if enabled is not None and not enabled():
        return "saved-tensor hooks are disabled here (torch.autograd.graph.disable_saved_tensors_hooks)"
    top = _top_hooks_accessor()
    cannot_tell = ("this torch has no way to read the active saved-tensor hooks, so foak cannot tell whether an "
                   "outer hook (save_on_cpu, activation offloading) is active")
    if top is None:
        return cannot_tell
    try:
        try:
            hooks = top(True)  # True: also while dynamo traces
        except TypeError:  # a torch whose accessor takes no argument
            hooks = top()
    except Exception:
        return cannot_tell
    if hooks is None:
        return None
    pack = hooks[0]
    name = getattr(pack, "__qualname__", None) or type(pack).__name__
    return f"an outer saved-tensor hook was active: {getattr(pack, '__module__', '?')}.{name}"


class recomputing_outputs:  # noqa: N801 (used like a function: ``with recomputing_outputs():``)
    """Within this scope, offered outputs are saved for the backward as recipes (see module doc).

    After entering, ``active`` says whether this scope installed its hooks; ``stepped_aside`` is the
    reason when it did not because other saved-tensor hooks were in the way (None otherwise, also for a
    scope nested in another one and under torch.compile, where there is nothing to add)."""

    __slots__ = ("active", "stepped_aside", "_hooks", "_offers")

    def __init__(self):
        self.active = False
        self.stepped_aside = None
        self._hooks = self._offers = None

    def __enter__(self):
        if torch.compiler.is_compiling() or _active() is not None:
            return self
        reason = outer_hooks_reason()
        if reason is not None:
            self.stepped_aside = reason
            return self
        hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        _state.offers = self._offers = {}
        try:
            hooks.__enter__()
        except BaseException:
            _state.offers = self._offers = None
            raise
        self._hooks, self.active = hooks, True
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.active:
            return None
        offers, hooks = self._offers, self._hooks
        self.active, self._hooks, self._offers = False, None, None
        try:
            hooks.__exit__(exc_type, exc, tb)
            if exc_type is None:
                for recipe in offers.values():
                    output = recipe.output()
                    if output is not None and recipe.pending and output._version != recipe.version:
                        raise RuntimeError(
                            "foak: an RMSNorm output saved for the backward was modified in place; its recomputed "
                            "value would not match. Disable foak's rms_norm switch for this model.")
        finally:
            _state.offers = None
        return None
