"""Memory accounting on CPU for tests: what a forward keeps for the backward, and the peak of live tensor
memory over a forward + backward (transient buffers of the backward included).

* :class:`LiveBytes` is a TorchDispatchMode that sees every aten op's outputs (the Triton launchers allocate
  with ``torch.empty``, which it sees too), counts each new storage's bytes once (by its data pointer) and
  subtracts them when the storage is freed (``weakref.finalize`` on the untyped storage, whose Python object
  torch keeps while the storage lives). Tensors that existed before the mode was entered (parameters, the
  batch) are not counted: the numbers are what the step itself allocates.
* :func:`saved_tensor_bytes` counts the distinct storages autograd saves during a forward (saved_tensors_hooks,
  deduplicated by storage). Note: foak's rms_norm_recompute scope steps aside under an outer saved-tensor
  hook, so whole-model measurements of foak use :func:`step_memory`'s ``retained`` (live bytes the graph
  holds after the forward) instead.

Triton's interpreter keeps every tensor a kernel launch received alive until the next garbage collection
(its host-copy helpers are recursive closures over a dict of the arguments' storages: a reference cycle),
which a GPU launch does not. :func:`interpreter_launches_without_cycles` (on during :func:`step_memory`)
hands CPU tensors to the interpreted kernel as they are (what those helpers amount to for CPU storages:
the "host copy" of a CPU storage is the storage itself), so tensors die when the program drops them.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self, exclude=()):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}
        # storages that existed before (parameters, buffers): an op's view of them allocates nothing
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type == "meta" or type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self._sizes or key in self._exclude:
            return
        self._sizes[key] = storage.nbytes()
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def reset_peak(self) -> None:
        self.peak = self.live


@contextlib.contextmanager
def interpreter_launches_without_cycles():
    try:
        from triton.runtime.interpreter import GridExecutor
    except ImportError:  # no interpreter: nothing to fix
        yield
        return

    init, restore = GridExecutor._init_args_hst, GridExecutor._restore_args_dev

    def on_cpu(values) -> bool:
        return all(v.device.type == "cpu" and type(v) is torch.Tensor for v in values
                   if hasattr(v, "data_ptr"))

    def init_args(self, args_dev, kwargs):
        if on_cpu(args_dev) and on_cpu(kwargs.values()):
            return list(args_dev), dict(kwargs)
        return init(self, args_dev, kwargs)

    def restore_args(self, args_dev, args_hst, kwargs, kwargs_hst):
        if not (on_cpu(args_dev) and on_cpu(kwargs.values())):
            restore(self, args_dev, args_hst, kwargs, kwargs_hst)

    GridExecutor._init_args_hst, GridExecutor._restore_args_dev = init_args, restore_args
    gc.collect()  # earlier launches' cycles
    try:
        yield
    finally:
        GridExecutor._init_args_hst, GridExecutor._restore_args_dev = init, restore


def step_memory(model, batch: dict) -> dict:
    """{'retained': bytes alive after the forward (saved activations + outputs), 'peak': peak live bytes over
    forward + backward, 'forward_peak': the forward's peak}, counted from the step's own allocations."""
    model.zero_grad(set_to_none=True)
    mode = LiveBytes(exclude=[*model.parameters(), *model.buffers()])
    with interpreter_launches_without_cycles(), mode:
        loss = model(**batch).loss
        retained, forward_peak = mode.live, mode.peak
        loss.backward()
    del loss
    return {"retained": retained, "peak": mode.peak, "forward_peak": forward_peak}


def saved_tensor_bytes(fn, *args, exclude=(), **kwargs) -> tuple[int, object]:
    """(bytes of the distinct storages autograd saved while running ``fn(*args, **kwargs)``, its result).
    Tensors whose storage is one of ``exclude`` (parameters, inputs) are not counted."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr and ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    return sum(seen.values()), out
