"""Offloaded activation checkpoints: the inputs that gradient checkpointing keeps per decoder layer live in
(pinned) CPU memory between the forward and the layer's recompute, instead of on the GPU.

Under HF's gradient checkpointing (non-reentrant or reentrant) a checkpointed layer keeps one thing for the
backward: the tensors it was called with (its hidden states), saved by torch.utils.checkpoint through
autograd's saved-tensor mechanism. The rule wraps each checkpointed layer's ``_gradient_checkpointing_func``
for the duration of the decoder stack's forward and installs saved-tensor hooks around that call only
(torch.autograd.graph.saved_tensors_hooks, the mechanism save_on_cpu and TRL's activation offloading are
built on). Those hooks see exactly the checkpoint's saved inputs: inside the layer the checkpoint's own hooks
(non-reentrant) take precedence, and the reentrant checkpoint runs the layer without grad. So nothing of the
layer's interior is offloaded, and foak's rms_norm_recompute scope, entered at the stack outside these
hooks, does not step aside.

On CUDA, the forward copies each saved input into pinned host memory on a side stream (the GPU block is
released once the copy is done: ``record_stream``); in the backward, when a layer's input is unpacked for
its recompute, the input of the layer before it is copied back on the side stream, overlapped with this
layer's recompute and backward, so it is on the GPU when its own recompute starts. Without CUDA (CPU-only
machines, the tests) the same hooks keep a separate CPU copy and nothing is overlapped.

Host pieces: an input goes to the host in pieces of ``_PIECE_BYTES`` (256 MiB) and one smaller tail, each its own
host tensor. CUDA's caching host allocator rounds every pinned block up to a power of two (an input of 3.125 GiB
would pin 4 GiB); in pieces the waste is at most the tail's rounding, the budget counts what is really pinned, and
the blocks are reused by the next steps whatever the sequence length.

Budget: pinned memory is finite. Inputs are offloaded in layer order while the bytes offloaded and not yet
released stay within the budget (``offload_budget_gib``; default: half the available RAM read when the model
is patched); the later layers' inputs stay on the GPU (the first layers' inputs wait longest for their
backward). The report row says how many layers were offloaded in the last forward. When pinned memory cannot
be allocated, the forward raises :class:`OffloadError` saying so (never a hang, never a silent fallback).
Without gradient checkpointing the rule offloads nothing and its report row says so.
"""

from __future__ import annotations

import os
import threading
import weakref

import torch
from torch import nn

from foak.alloc_conf import PINNED_HOST_TEXT, as_dict, settings
from foak.patching.rules import Rule, Trigger, at_trace_time, call_next

__all__ = ["DEFAULT_RAM_FRACTION", "OffloadError", "available_ram_bytes", "offload_activations_rule"]

DEFAULT_RAM_FRACTION = 0.5
_GIB = 2**30


class OffloadError(RuntimeError):
    """Pinned host memory for an offloaded layer input could not be allocated."""


def available_ram_bytes() -> int:
    """MemAvailable of /proc/meminfo (Linux), else free physical pages; 0 when neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _total_ram_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _host_buffer(like: torch.Tensor) -> torch.Tensor:
    """The host tensor a piece of an offloaded input is copied into (pinned for a CUDA tensor). Tests replace it."""
    return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=like.is_cuda)


_PIECE_BYTES = 1 << 28  # an offloaded input's host copy is made of pieces of at most this many bytes


def _pieces(nbytes: int) -> list[tuple[int, int]]:
    """Byte ranges [start, stop) of the host pieces of an input of ``nbytes`` bytes."""
    return [(start, min(start + _PIECE_BYTES, nbytes)) for start in range(0, nbytes, _PIECE_BYTES)]


def host_bytes(nbytes: int, pinned: bool) -> int:
    """Host bytes an input of ``nbytes`` takes in pieces: pinned blocks are rounded up to a power of two by CUDA's
    caching host allocator (a full piece is one already); plain host memory is taken as asked."""
    if not pinned:
        return nbytes
    return sum(1 << (stop - start - 1).bit_length() for start, stop in _pieces(nbytes))


def _gib(n: float) -> str:
    return f"{n / _GIB:.3g} GiB"


class _Budget:
    """Bytes of offloaded inputs alive now (all stacks of one patched model share it), and the last forward's
    counts for the report."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_use = 0
        self.lock = threading.Lock()
        self.streams: dict[torch.device, torch.cuda.Stream] = {}

    def reserve(self, nbytes: int) -> bool:
        with self.lock:
            if self.in_use + nbytes > self.limit:
                return False
            self.in_use += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self.lock:
            self.in_use -= nbytes

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self.streams.get(device)
        if stream is None:
            stream = self.streams[device] = torch.cuda.Stream(device)
        return stream


class _Offloaded:
    """A saved input living on the host (``host``), or kept where it was (``kept``) when the budget ran out."""

    __slots__ = ("__weakref__", "budget", "device", "dtype", "event", "fetched", "host", "kept", "layer", "nbytes",
                 "session", "shape")

    def __init__(self, session, layer):
        self.session, self.layer = session, layer
        self.budget = session.budget
        self.host = self.kept = self.event = self.fetched = None
        self.nbytes = 0  # host bytes held (counted in the budget)
        self.device = self.dtype = self.shape = None

    def __del__(self):
        if self.host is not None and self.budget is not None:
            self.budget.release(self.nbytes)


class _Session:
    """One forward of one decoder stack: the handles per checkpointed layer (weakly: autograd owns them and
    drops each after the backward used it), the prefetch order, the counts."""

    def __init__(self, budget: _Budget, layers: int):
        self.budget = budget
        self.handles: list[list[weakref.ref]] = [[] for _ in range(layers)]
        self.offloaded_bytes = 0
        self.offloaded_layers: set[int] = set()
        self.kept_layers: set[int] = set()
        self.leaf_layers: set[int] = set()
        self.pinned = False

    def hooks(self, layer: int) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(lambda t: self.pack(t, layer), self.unpack)

    def pack(self, t: torch.Tensor, layer: int):
        if isinstance(t, nn.Parameter) or t.numel() == 0 or t.device.type == "meta":
            return t
        handle = _Offloaded(self, layer)
        self.handles[layer].append(weakref.ref(handle))
        base = t if t._base is None else t._base
        if t.requires_grad and base.requires_grad and base.grad_fn is None:
            # a leaf of the graph (the embedding output that HF's enable_input_require_grads makes require grad when
            # the embedding is frozen: LoRA, QLoRA), or a view of one (FSDP2 passes a layer's inputs through its
            # RegisterPostBackwardFunction before the checkpoint sees them: an alias of the leaf with a grad_fn):
            # autograd's AccumulateGrad node holds the leaf's storage until the backward, so a host copy would free
            # nothing on the device and spend the budget
            handle.kept = t.detach()
            self.leaf_layers.add(layer)
            return handle
        source = t.detach()
        if not source.is_contiguous():
            source = source.contiguous()
        flat = source.reshape(-1).view(torch.uint8)
        nbytes = flat.numel()
        held = host_bytes(nbytes, t.is_cuda)
        if not self.budget.reserve(held):
            handle.kept = t.detach()  # (no reference to the autograd graph from the handle)
            self.kept_layers.add(layer)
            return handle
        handle.nbytes, handle.device, handle.dtype, handle.shape = held, t.device, t.dtype, t.shape
        try:
            host = [_host_buffer(flat[start:stop]) for start, stop in _pieces(nbytes)]
        except RuntimeError as err:
            self.budget.release(held)
            raise OffloadError(
                f"foak offload_activations: could not allocate {held / 2**20:.1f} MiB of "
                f"{'pinned ' if t.is_cuda else ''}host memory for the input of checkpointed layer {layer} "
                f"({_gib(self.budget.in_use)} offloaded and alive, budget {_gib(self.budget.limit)}): {err}. "
                "Lower offload_budget_gib, free host memory, or switch offload_activations off") from err
        if t.is_cuda:
            self.pinned = True
            stream = self.budget.side_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                for piece, (start, stop) in zip(host, _pieces(nbytes)):
                    piece.copy_(flat[start:stop], non_blocking=True)
                handle.event = stream.record_event()
            source.record_stream(stream)  # the GPU block is reused only after the copy
        else:
            for piece, (start, stop) in zip(host, _pieces(nbytes)):
                piece.copy_(flat[start:stop])
        handle.host = host
        self.offloaded_bytes += held
        self.offloaded_layers.add(layer)
        return handle

    @staticmethod
    def _assemble(handle: _Offloaded, out: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        """Copy the host pieces into the flat byte tensor ``out``; the input's tensor (dtype, shape) over it."""
        for piece, (start, stop) in zip(handle.host, _pieces(out.numel())):
            out[start:stop].copy_(piece, non_blocking=non_blocking)
        return out.view(handle.dtype).view(handle.shape)

    def _fetch(self, handle: _Offloaded) -> None:
        """Start copying ``handle``'s input back to its device on the side stream (CUDA only)."""
        if handle.fetched is not None or handle.host is None or handle.device.type != "cuda":
            return
        stream = self.budget.side_stream(handle.device)
        with torch.cuda.stream(stream):
            stream.wait_event(handle.event)
            nbytes = sum(piece.numel() for piece in handle.host)
            value = self._assemble(handle, torch.empty(nbytes, dtype=torch.uint8, device=handle.device), True)
            handle.fetched = (value, stream.record_event())

    def _prefetch_before(self, layer: int) -> None:
        for earlier in range(layer - 1, -1, -1):
            handles = [h for h in (ref() for ref in self.handles[earlier]) if h is not None]
            if handles:
                for h in handles:
                    self._fetch(h)
                return

    def unpack(self, handle):
        if not isinstance(handle, _Offloaded):
            return handle
        if handle.kept is not None:
            value = handle.kept
        elif handle.device.type == "cuda":
            self._fetch(handle)
            value, event = handle.fetched
            handle.fetched = None  # another unpack (retain_graph) fetches again
            current = torch.cuda.current_stream(handle.device)
            current.wait_event(event)
            value.record_stream(current)
        else:  # the CPU, or another accelerator: a plain synchronous copy back
            nbytes = sum(piece.numel() for piece in handle.host)
            value = self._assemble(handle, torch.empty(nbytes, dtype=torch.uint8, device=handle.device), False)
        self._prefetch_before(handle.layer)  # the next layer the backward recomputes
        return value


def _layer_lists(stack: nn.Module) -> list[nn.ModuleList]:
    """The stack's direct ModuleList children that hold HF GradientCheckpointingLayers (``layers``, ``h``)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [child for child in stack.children() if isinstance(child, nn.ModuleList)
            and any(isinstance(m, GradientCheckpointingLayer) for m in child)]


def _checkpointed_layers(stack: nn.Module) -> list[nn.Module]:
    return [m for layers in _layer_lists(stack) for m in layers if getattr(m, "gradient_checkpointing", False)
            and callable(m.__dict__.get("_gradient_checkpointing_func"))]


def _is_decoder_stack(module: nn.Module, model: nn.Module) -> bool:
    return bool(_layer_lists(module))


def budget_bytes(budget_gib: float | None) -> int:
    """The budget in bytes: ``budget_gib``, or DEFAULT_RAM_FRACTION of the available RAM (read now). A clear
    ValueError for a budget the machine's RAM cannot hold."""
    if budget_gib is None:
        return int(DEFAULT_RAM_FRACTION * available_ram_bytes())
    limit = int(budget_gib * _GIB)
    total = _total_ram_bytes()
    if total and limit > total:
        raise ValueError(f"offload_budget_gib={budget_gib:g} is more than this machine's RAM ({_gib(total)}); "
                         f"offloaded activations live in (pinned) host memory: give at most what is free "
                         f"(available now: {_gib(available_ram_bytes())})")
    return limit


def offload_activations_rule(arch: str, budget_gib: float | None = None) -> Rule:
    """The rule on every decoder stack (a module with a ModuleList of HF GradientCheckpointingLayers); see
    the module docstring. One budget for all the stacks it patches."""
    rule_id = f"{arch}.offload_activations"
    budget = _Budget(budget_bytes(budget_gib))
    origin = "offload_budget_gib" if budget_gib is not None else f"{DEFAULT_RAM_FRACTION:g} of the available RAM"

    def patch(module, model, state):
        row = state.result
        row._backend = _BACKEND  # (what moves the tensors; no kernel runs here)
        counts = {"forwards": 0, "unchecked": 0, "traced": 0}

        def note_compiled(ctx):  # (run by dynamo while it traces: see at_trace_time)
            counts["traced"] += 1
            row.note_runtime("compiled", (
                f"torch.compile traced the decoder stack {counts['traced']} time(s): its compiled forwards offload "
                "nothing (saved-tensor hooks are not traced; the compiler plans the memory)"))

        def forward(self, *args, **kwargs):
            if torch.compiler.is_compiling():  # (saved-tensor hooks do not trace; the compiler plans memory)
                at_trace_time(note_compiled)
                return call_next(self, rule_id, *args, **kwargs)
            layers = _checkpointed_layers(self) if self.training and torch.is_grad_enabled() else []
            if not layers:
                if self.training and torch.is_grad_enabled():
                    counts["unchecked"] += 1
                    row.note_runtime("no_checkpointing", (
                        f"{counts['unchecked']} training forward(s) without gradient checkpointing: nothing "
                        "offloaded (it offloads the checkpointed layers' inputs; enable gradient checkpointing)"))
                    # the last forward offloaded nothing: no earlier forward's count stays as if it were the last
                    row.note_runtime(f"offloaded {type(self).__name__}", None)
                    stats = state_of(self)
                    for key in _LAST_FORWARD_KEYS:
                        stats.pop(key, None)
                return call_next(self, rule_id, *args, **kwargs)
            session = _Session(budget, len(layers))
            originals = [layer.__dict__["_gradient_checkpointing_func"] for layer in layers]

            def offloading(index, checkpoint):
                def run(function, *a, **k):
                    with session.hooks(index):
                        return checkpoint(function, *a, **k)
                return run

            for index, (layer, checkpoint) in enumerate(zip(layers, originals)):
                layer._gradient_checkpointing_func = offloading(index, checkpoint)
            try:
                out = call_next(self, rule_id, *args, **kwargs)
            finally:
                for layer, checkpoint in zip(layers, originals):
                    layer._gradient_checkpointing_func = checkpoint
            counts["forwards"] += 1
            offloaded = len(session.offloaded_layers - session.kept_layers - session.leaf_layers)
            kept, leaves = len(session.kept_layers - session.leaf_layers), len(session.leaf_layers)
            text = (f"last forward of {type(self).__name__}: {offloaded} of {len(layers)} checkpointed layers' inputs offloaded to "
                    f"{'pinned CPU' if session.pinned else 'CPU'} memory "
                    f"({_gib(session.offloaded_bytes)}{'; ' + pinning() if session.pinned else ''})")
            if kept:
                text += f", {kept} kept on the device: budget {_gib(budget.limit)} ({origin}) spent"
            if leaves:
                text += (f", {leaves} kept on the device: a leaf of the autograd graph (an input that requires "
                         "grad without a grad_fn, or a view of one, e.g. the frozen embedding's output under PEFT), "
                         "which autograd holds until the backward anyway")
            row.note_runtime(f"offloaded {type(self).__name__}", text)  # (one note per stack class: multimodal)
            state_of(self).update(layers=len(layers), offloaded_layers=offloaded, kept_layers=kept,
                                  leaf_layers=leaves, offloaded_bytes=session.offloaded_bytes,
                                  forwards=counts["forwards"])
            return out

        return forward

    def skip_reason(model):
        if any(_is_decoder_stack(m, model) for m in model.modules()):
            return None
        return ("no module holding a ModuleList of transformers GradientCheckpointingLayers (the layers HF's "
                "gradient checkpointing wraps): nothing to offload")

    return Rule(rule_id, "offload_activations", Trigger(nn.Module, predicate=_is_decoder_stack), patch, skip_reason)


_BACKEND = "pinned host memory + side CUDA stream (CUDA); host copy (CPU)"


def pinning(environ=None) -> str:
    """How torch's pinned host allocator takes page-locked memory, as the allocator settings in the environment
    say (foak.alloc_conf): by cudaHostRegister on several threads when ``pinned_use_cuda_host_register`` is on,
    else by one cudaHostAlloc per block, ~4x slower on the H200 machine (docs/long-context.md)."""
    conf = as_dict(settings(environ)[1])
    if conf.get("pinned_use_cuda_host_register", "").lower() == "true":
        threads = conf.get("pinned_num_register_threads", "1")
        return f"pinned by cudaHostRegister on {threads} thread{'s' if threads != '1' else ''}"
    return (f"pinned by cudaHostAlloc, torch's default: {PINNED_HOST_TEXT} in PYTORCH_CUDA_ALLOC_CONF before torch "
            "starts pins ~4x faster")


_STATS = "_foak_offload_stats"
_LAST_FORWARD_KEYS = ("layers", "offloaded_layers", "kept_layers", "leaf_layers", "offloaded_bytes")


def state_of(stack: nn.Module) -> dict:
    """The last forward's counts of a patched decoder stack: ``layers`` (checkpointed), ``offloaded_layers``,
    ``kept_layers`` (budget spent), ``leaf_layers`` (an input autograd holds anyway: not offloaded),
    ``offloaded_bytes``, ``forwards`` (forwards that offloaded). After a training forward without checkpointing
    only ``forwards`` is left."""
    stats = stack.__dict__.get(_STATS)
    if stats is None:
        stats = stack.__dict__[_STATS] = {}
    return stats
