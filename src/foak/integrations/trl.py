"""TRL's fused LM head served by foak's linear_cross_entropy.

TRL's trainers (SFT, DPO, GRPO, ... in TRL 1.x) replace the model's forward with a fused LM head
(``trl.trainer.utils.add_fused_lm_head``): called with ``fused_lm_head=True`` it runs the backbone and
scores the next-token labels itself, through the module global
``trl.trainer.utils._ChunkedLogProbFunction.apply(hidden, weight, bias, targets, temperature, chunk_size,
final_logit_softcapping, logit_scale, outputs)``, which returns per-token ``(log_probs, entropy,
log_sum_sq_probs, mean_logits, is_top1)`` of ``z = softcap(logits * logit_scale) / temperature``. The causal
LM's own forward, lm_head and loss_function never run, so foak's fused_linear_loss rule would not act.

While a model patched with fused_linear_loss is alive, that global is a stand-in which computes the request
with foak's ``linear_cross_entropy`` when ``weight`` is the lm_head weight of such a model and foak can
express it, and hands it to TRL's own function otherwise, writing why into the rule's report row (and
warning once). A model foak did not patch always gets TRL's function. The global is installed once per
process (when TRL is imported after foak.patch, by an import hook as trl.trainer.utils loads), ref-counted,
and restored when the last patched model is restored or garbage-collected.
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref

import torch

import foak.ops.linear_cross_entropy as lce  # called through the module (tests count the calls)

_TRL_UTILS, _GLOBAL = "trl.trainer.utils", "_ChunkedLogProbFunction"
# what foak computes (TRL's kernel also offers log_sum_sq_probs and mean_logits)
_SERVED_OUTPUTS = {"log_probs", "entropy", "is_top1"}

_lock = threading.Lock()
_heads: dict[int, _Head] = {}  # id(_Head) -> _Head, one per patched causal LM
_install: list = []  # [trl.trainer.utils module, TRL's original object] while installed


class _Head:
    """A patched model's lm_head and the report row (RuleResult) that tells what became of its TRL calls."""

    def __init__(self, lm_head, result, chunk_bytes):
        self.module = weakref.ref(lm_head)
        self.result, self.chunk_bytes = result, chunk_bytes
        self.served = 0
        self.fallbacks: dict[str, int] = {}  # reason -> calls

    def chunk_bytes_for(self, weight) -> int | None:
        return self.chunk_bytes(weight) if callable(self.chunk_bytes) else self.chunk_bytes

    def count_served(self) -> None:
        self.served += 1
        self.result.note_runtime("trl", f"served TRL's fused LM head ({_calls(self.served)})")

    def count_fallback(self, reason: str) -> None:
        calls = self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        self.result.note_runtime(f"trl: {reason}", f"TRL's own kernel ran {_calls(calls)}: {reason}")
        if calls == 1:
            warnings.warn(f"foak {self.result.rule_id}: TRL's own kernel runs: {reason}", stacklevel=4)


def _calls(n: int) -> str:
    return f"{n} call" if n == 1 else f"{n} calls"


def serve_trl_fused_head(causal_lm, state, chunk_bytes=None) -> None:
    """Called by the fused_linear_loss rule for each causal LM it patches (``state.result`` is its report
    row; ``chunk_bytes``: linear_cross_entropy's chunk budget, an int or a function of the weight, read at
    call time): from now until ``state`` is restored, or the lm_head is garbage-collected, TRL's fused LM head on
    this model runs foak's loss, whether TRL is imported before or after."""
    head = _Head(causal_lm.lm_head, state.result, chunk_bytes)
    with _lock:
        _heads[id(head)] = head
        _sync()
    state.on_restore(weakref.finalize(causal_lm.lm_head, _release, id(head)))


def _release(key: int) -> None:
    with _lock:
        _heads.pop(key, None)
        _sync()


def _sync() -> None:
    """(under _lock) While a patched model exists: the stand-in is installed if trl.trainer.utils is loaded,
    else an import hook waits for it. Without one: TRL's original is back and no hook is left."""
    trl_utils = sys.modules.get(_TRL_UTILS)
    if _heads and trl_utils is None:
        if _HOOK not in sys.meta_path:
            sys.meta_path.insert(0, _HOOK)
        return
    if _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)
    if _heads and not _install and hasattr(getattr(trl_utils, _GLOBAL, None), "apply"):
        # (a TRL without the fused head has the model compute its loss: the rule acts as usual)
        original = getattr(trl_utils, _GLOBAL)
        setattr(trl_utils, _GLOBAL, _FoakChunkedLogProb(original))
        _install[:] = [trl_utils, original]
    elif not _heads and _install:
        trl_utils, original = _install
        if isinstance(getattr(trl_utils, _GLOBAL, None), _FoakChunkedLogProb):  # else: set over foak's since
            setattr(trl_utils, _GLOBAL, original)
        _install.clear()


class _TrlImportHook:
    """A sys.meta_path finder for a TRL imported after foak.patch: the stand-in goes in as soon as
    trl.trainer.utils has been executed (before any trainer exists)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TRL_UTILS:
            return None
        for finder in list(sys.meta_path):
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if hasattr(spec.loader, "exec_module"):
                        spec.loader = _ThenSync(spec.loader)
                    return spec
        return None


class _ThenSync:
    """The module's own loader, then _sync()."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):  # get_source, get_resource_reader, ...: the wrapped loader's
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        with _lock:
            _sync()


_HOOK = _TrlImportHook()


def _served_head(weight) -> _Head | None:
    with _lock:
        heads = [(head, head.module()) for head in _heads.values()]
    for head, module in heads:
        if module is not None and module.weight is weight:
            return head
    for head, module in heads:  # FSDP2: TRL passes the gathered weight.full_tensor(), not the parameter
        if module is not None and _sharded(module.weight) and tuple(module.weight.shape) == tuple(weight.shape):
            head.count_fallback("lm_head sharded as a DTensor (FSDP2): TRL gathers it and scores with its own "
                               "kernel, which foak cannot tell from another model's head")
    return None


def _sharded(weight) -> bool:
    return type(weight).__name__ == "DTensor"


def _cannot_serve(hidden, weight, bias, temperature, softcap, logit_scale, outputs) -> str | None:
    """Why foak cannot compute this TRL request (None: it can)."""
    extra = sorted(set(outputs) - _SERVED_OUTPUTS)
    if extra:
        return f"outputs {extra} requested (foak computes {sorted(_SERVED_OUTPUTS)})"
    if not logit_scale > 0 or not temperature > 0:
        return f"logit_scale={logit_scale}, temperature={temperature} (foak needs both > 0)"
    if softcap is not None and temperature != 1:
        return "final-logit softcap with temperature != 1 (TRL divides by the temperature after the softcap)"
    if hasattr(weight, "ds_id"):
        return "lm_head partitioned by DeepSpeed ZeRO-3 (TRL re-gathers it in its backward)"
    if hidden.shape[0] == 0:
        return "a micro-batch with no scored token"
    if not torch.is_autocast_enabled(hidden.device.type) and (
            hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype)):
        return (f"{hidden.dtype} hidden states and a {weight.dtype} lm_head outside autocast "
                "(cast_lm_head_to_fp32)")
    return None


class _FoakChunkedLogProb:
    """Stands in for ``trl.trainer.utils._ChunkedLogProbFunction`` (only ``apply`` is called on it)."""

    def __init__(self, original):
        self.original = original

    def apply(self, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")):
        trl_args = (hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale,
                    outputs)
        head = _served_head(weight)
        if head is None:  # a model foak did not patch
            return self.original.apply(*trl_args)
        reason = _cannot_serve(hidden, weight, bias, temperature, final_logit_softcapping, logit_scale, outputs)
        if reason:
            head.count_fallback(reason)
            return self.original.apply(*trl_args)
        want_accuracy, want_entropy = "is_top1" in outputs, "entropy" in outputs
        # z = logits * logit_scale / temperature; foak divides the logits by logits_scaling
        result = lce.linear_cross_entropy(
            hidden, weight, targets, bias, reduction="none", softcap=final_logit_softcapping,
            logits_scaling=temperature / logit_scale, return_token_accuracy=want_accuracy,
            return_entropy=want_entropy, precompute_row_grad=True, chunk_bytes=head.chunk_bytes_for(weight))
        loss, *extras = result if isinstance(result, tuple) else (result,)
        accuracy = extras.pop(0) if want_accuracy else None
        entropy = extras.pop(0) if want_entropy else None
        if entropy is not None and torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (hidden, weight, bias)):
            entropy = _EntropyGradientFromTrl.apply(entropy, hidden, weight, bias, targets, trl_args[4:],
                                                    self.original, head)
        is_top1 = accuracy.bool() if accuracy is not None else None
        head.count_served()
        return -loss, entropy, None, None, is_top1


class _EntropyGradientFromTrl(torch.autograd.Function):
    """foak's entropy has no gradient. This passes it through and, should a caller differentiate it (GRPO's
    entropy bonus), takes its gradient from TRL's own kernel and says so in the report row. Saving the inputs
    costs no memory: linear_cross_entropy keeps the same tensors for its own backward."""

    @staticmethod
    def forward(ctx, entropy, hidden, weight, bias, targets, trl_args, original, head):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.trl_args, ctx.original, ctx.head = trl_args, original, head
        device = hidden.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        return entropy.clone()

    @staticmethod
    def backward(ctx, grad_entropy):
        if grad_entropy is None:
            return (None,) * 8
        ctx.head.count_fallback("the entropy was differentiated (e.g. an entropy bonus): its gradient comes "
                                "from TRL's kernel (foak's entropy has none)")
        hidden, weight, bias, targets = ctx.saved_tensors
        temperature, chunk_size, softcap, logit_scale, _ = ctx.trl_args
        inputs = [t.detach().requires_grad_(need) if t is not None else None
                  for t, need in zip((hidden, weight, bias), ctx.needs_input_grad[1:4])]
        device, dtype, enabled = ctx.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            _, entropy, *_ = ctx.original.apply(*inputs, targets, temperature, chunk_size, softcap, logit_scale,
                                                ("entropy",))
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(entropy, wanted, grad_entropy))
        dh, dw, db = (next(grads) if t is not None and t.requires_grad else None for t in inputs)
        return None, dh, dw, db, None, None, None, None


# the fused_linear_loss rule calls serve_trl_fused_head for every causal LM it patches
from foak.patching.replacements import FUSED_HEAD_HOOKS  # noqa: E402

if serve_trl_fused_head not in FUSED_HEAD_HOOKS:
    FUSED_HEAD_HOOKS.append(serve_trl_fused_head)
