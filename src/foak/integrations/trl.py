"""TRL's fused LM head served by foak's linear_log_probs and linear_cross_entropy.

TRL's trainers (SFT, DPO, GRPO, RLOO, KTO in TRL 1.x) replace the model's forward with a fused LM head
(``trl.trainer.utils.add_fused_lm_head``): called with ``fused_lm_head=True`` it runs the backbone and
scores the next-token labels itself, through the module global
``trl.trainer.utils._ChunkedLogProbFunction.apply(hidden, weight, bias, targets, temperature, chunk_size,
final_logit_softcapping, logit_scale, outputs)``, which returns per-token ``(log_probs, entropy,
log_sum_sq_probs, mean_logits, is_top1)`` of ``z = softcap(logits * logit_scale) / temperature`` (the
outputs not requested are None; log_probs and entropy are differentiable). The causal LM's own forward,
lm_head and loss_function never run, so foak's fused_linear_loss rule would not act.

While a model patched with fused_linear_loss is alive, that global is a stand-in. When ``weight`` is the
lm_head weight of such a model (or of a trainable copy PEFT's modules_to_save made of that lm_head) it
computes every output TRL can request, with TRL's temperature, logit scale and softcap, hidden and weight of
different dtypes outside autocast (``cast_lm_head_to_fp32``), and gradients through log_probs and entropy:
- SFT's request (``is_top1`` without ``mean_logits``/``log_sum_sq_probs``, no softcap with a temperature
  != 1) with ``linear_cross_entropy(reduction="none", precompute_row_grad=True)``: SFT's loss is the mean of
  the log-probs, so its gradient is computed in the forward; an entropy that is differentiated after all gets
  its gradient from ``linear_log_probs``;
- every other request (DPO, KTO, GRPO, RLOO, the reference models) with ``linear_log_probs``.
Under ``torch.no_grad()`` (reference models, PEFT policies with the adapter disabled) neither saves anything
for a backward. Each served call is counted in the rule's report row ("served TRL's fused LM head (N
calls)"). foak hands the call to TRL's own function, counting it in that row with the reason (and warning
once), for an output name foak does not know, a zero or non-finite temperature or logit scale, an lm_head
partitioned by DeepSpeed ZeRO-3, or one sharded by FSDP2 and gathered without a gradient (a frozen head, a
no-grad forward: TRL passes a gathered copy foak cannot tell from another model's head; a trained FSDP2 head's
copy is recognised through its autograd graph and served). A model foak did not patch always gets TRL's function (each patched model's row counts those calls). The global is installed once
per process (when TRL is imported after foak.patch, by an import hook as trl.trainer.utils loads),
ref-counted, and restored when the last patched model is restored or garbage-collected.

A model patched with fast_loss (foak's cross_entropy on the logits the model's loss_function receives) is not
served: TRL's fused head never builds those logits nor calls loss_function, so its calls run TRL's own kernel and
are counted in the fast_loss row with that reason (and a warning, once), instead of the row claiming a loss
kernel that never ran.
"""

from __future__ import annotations

import math
import sys
import threading
import warnings
import weakref

import torch

import foak.ops.linear_cross_entropy as lce  # called through the modules (tests count the calls)
import foak.ops.linear_log_probs as llp

_TRL_UTILS, _GLOBAL = "trl.trainer.utils", "_ChunkedLogProbFunction"

_lock = threading.Lock()
_heads: dict[int, _Head] = {}  # id(_Head) -> _Head, one per patched causal LM
_install: list = []  # [trl.trainer.utils module, TRL's original object] while installed


class _Head:
    """A patched model's lm_head and the report row (RuleResult) that tells what became of its TRL calls."""

    def __init__(self, causal_lm, result, chunk_bytes, serve: bool = True):
        self.module = weakref.ref(causal_lm.lm_head)
        self.causal_lm = weakref.ref(causal_lm)
        self.result, self.chunk_bytes = result, chunk_bytes
        self.serve = serve  # False: a fast_loss row, which only counts TRL's calls (see watch_trl_fused_head)
        self.served = 0
        self.fallbacks: dict[str, int] = {}  # reason -> calls
        # set once an entropy this head returned received a gradient (TRL's GRPO entropy bonus: constant for a run);
        # from then on a frozen head's forward leaves the gradient to the recomputing backward (linear_log_probs
        # entropy_grad: 3 GEMM passes instead of 4)
        self.entropy_differentiated = False

    def owns(self, module, weight) -> bool:
        """Whether ``weight`` is this head's: the patched lm_head's, or that of a trainable copy PEFT made of it
        after foak.patch (``modules_to_save=["lm_head"]``: the causal LM's lm_head is now PEFT's wrapper, and TRL
        passes the active copy's weight)."""
        if module.weight is weight:
            return True
        causal_lm = self.causal_lm()
        return causal_lm is not None and any(
            linear.weight is weight for linear in head_linears(getattr(causal_lm, "lm_head", None)))

    def chunk_bytes_for(self, weight) -> int | None:
        return self.chunk_bytes(weight) if callable(self.chunk_bytes) else self.chunk_bytes

    def saw_entropy_gradient(self, _grad) -> None:
        if not self.entropy_differentiated:
            self.entropy_differentiated = True
            self.result.note_runtime("trl entropy", "the entropy received a gradient (an entropy bonus): the "
                                     "backward recomputes the logits from the next call on")

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
    head = _Head(causal_lm, state.result, chunk_bytes)
    with _lock:
        _heads[id(head)] = head
        _sync()
    state.on_restore(weakref.finalize(causal_lm.lm_head, _release, id(head)))


FAST_LOSS = ("TRL's fused LM head computes the loss from the hidden states and never calls the model's "
             "loss_function, so fast_loss's cross_entropy did not run; set fused_linear_loss (instead of fast_loss) "
             "for foak to serve it")


def watch_trl_fused_head(causal_lm, state) -> None:
    """Called by the fast_loss rule for each causal LM it patches: TRL's fused LM head on this model (TRL 1.x's
    trainers call it instead of the model's loss) runs TRL's own kernel, and each call is counted in the rule's
    row with the reason (and a warning, once): the row then says that foak's loss did not run."""
    head = _Head(causal_lm, state.result, None, serve=False)
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


def _served_head(weight) -> _Head | bool | None:
    with _lock:
        heads = [(head, head.module()) for head in _heads.values()]
    for head, module in heads:
        if module is not None and head.owns(module, weight):
            return head
    # FSDP2: TRL passes the gathered weight.full_tensor(), a new tensor. When the head is trained, autograd
    # links that tensor to the sharded parameter; without a gradient nothing does.
    sharded = [(head, module) for head, module in heads if module is not None and _sharded(module.weight)
               and tuple(module.weight.shape) == tuple(weight.shape)]
    for head, module in sharded:
        if _gathered_from(weight, module.weight):
            return head
    for head, _ in sharded:
        head.count_fallback("lm_head sharded as a DTensor (FSDP2) and gathered without a gradient (a frozen "
                            "head or a no-grad forward): foak cannot tell TRL's gathered copy from another "
                            "model's head")
    if sharded:
        return False  # (counted)
    for head, module in heads:  # e.g. the reference model a DPO/GRPO/RLOO trainer loaded itself
        if module is not None and head.serve:
            head.count_fallback(OTHER_MODEL)
    return None


OTHER_MODEL = ("a model foak did not patch called it (a reference model the trainer loaded itself? "
               "foak.patch(trainer.ref_model) serves it)")


def _gathered_from(weight, parameter, depth: int = 8) -> bool:
    """Whether ``weight``'s autograd graph reaches ``parameter`` within ``depth`` steps (DTensor.full_tensor:
    to_local <- redistribute <- the parameter's AccumulateGrad)."""
    stack, seen = [(weight.grad_fn, 0)], set()
    while stack:
        node, level = stack.pop()
        if node is None or level > depth or id(node) in seen:
            continue
        seen.add(id(node))
        if getattr(node, "variable", None) is parameter:
            return True
        stack.extend((child, level + 1) for child, _ in node.next_functions)
    return False


def _sharded(weight) -> bool:
    return type(weight).__name__ == "DTensor"


def _cannot_serve(hidden, weight, bias, temperature, softcap, logit_scale, outputs) -> str | None:
    """Why foak cannot compute this TRL request (None: it can)."""
    unknown = sorted(set(outputs) - set(llp.OUTPUTS))
    if unknown:
        return f"outputs {unknown} requested (foak computes {list(llp.OUTPUTS)})"
    if not (_finite(temperature) and temperature != 0 and _finite(logit_scale)):
        return f"temperature={temperature}, logit_scale={logit_scale} (foak needs finite values, temperature != 0)"
    if softcap is not None and not (_finite(softcap) and softcap > 0):
        return f"final_logit_softcapping={softcap} (foak needs a positive number)"
    if hasattr(weight, "ds_id"):
        return "lm_head partitioned by DeepSpeed ZeRO-3 (TRL re-gathers it in its backward)"
    return None


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _sft_request(hidden, weight, bias, temperature, softcap, logit_scale, outputs) -> bool:
    """A request linear_cross_entropy serves faster: TRL's SFT head (it alone asks for is_top1 without
    mean_logits), whose loss is the mean of the log-probs, so the gradient can be computed in the forward
    (precompute_row_grad: 3 GEMM passes instead of 4; if the promise of equal row gradients is broken, the
    backward recomputes it exactly)."""
    return ("is_top1" in outputs and set(outputs) <= {"log_probs", "entropy", "is_top1"} and hidden.shape[0] > 0
            and temperature > 0 and logit_scale > 0 and (softcap is None or temperature == 1)
            and (torch.is_autocast_enabled(hidden.device.type) or (
                hidden.dtype == weight.dtype and (bias is None or bias.dtype == weight.dtype))))


class _FoakChunkedLogProb:
    """Stands in for ``trl.trainer.utils._ChunkedLogProbFunction`` (only ``apply`` is called on it)."""

    def __init__(self, original):
        self.original = original

    def apply(self, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")):
        trl_args = (hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale,
                    outputs)
        head = _served_head(weight)
        if not head:  # a model foak did not patch (counted in the patched models' rows), or a sharded head
            return self.original.apply(*trl_args)
        if not head.serve:  # a model patched with fast_loss: TRL's kernel, said in its row
            head.count_fallback(FAST_LOSS)
            return self.original.apply(*trl_args)
        reason = _cannot_serve(hidden, weight, bias, temperature, final_logit_softcapping, logit_scale, outputs)
        if reason:
            head.count_fallback(reason)
            return self.original.apply(*trl_args)
        options = dict(temperature=temperature, logit_scale=logit_scale, softcap=final_logit_softcapping)
        if _sft_request(hidden, weight, bias, temperature, final_logit_softcapping, logit_scale, outputs):
            result = _sft_log_probs(hidden, weight, bias, targets, outputs, options, head)
        else:
            wanted = {name: name in outputs for name in llp.OUTPUTS[1:]}
            result = tuple(llp.linear_log_probs(hidden, weight, targets, bias, **options, **wanted,
                                                chunk_bytes=head.chunk_bytes_for(weight),
                                                entropy_grad=wanted["entropy"] and head.entropy_differentiated))
            entropy = result[1]
            frozen = not weight.requires_grad and not (bias is not None and bias.requires_grad)
            if frozen and entropy is not None and entropy.requires_grad and not head.entropy_differentiated and not (
                    torch.compiler.is_compiling()):
                entropy.register_hook(head.saw_entropy_gradient)
        head.count_served()
        return result


def _sft_log_probs(hidden, weight, bias, targets, outputs, options, head):
    """TRL's outputs from linear_cross_entropy (z = logits * logit_scale / temperature, before any softcap;
    foak divides the logits by logits_scaling)."""
    want_accuracy, want_entropy = "is_top1" in outputs, "entropy" in outputs
    result = lce.linear_cross_entropy(
        hidden, weight, targets, bias, reduction="none", softcap=options["softcap"],
        logits_scaling=options["temperature"] / options["logit_scale"], return_token_accuracy=want_accuracy,
        return_entropy=want_entropy, precompute_row_grad=True, chunk_bytes=head.chunk_bytes_for(weight))
    loss, *extras = result if isinstance(result, tuple) else (result,)
    accuracy = extras.pop(0) if want_accuracy else None
    entropy = extras.pop(0) if want_entropy else None
    if entropy is not None and torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (hidden, weight, bias)):
        entropy = _EntropyGradient.apply(entropy, hidden, weight, bias, targets, options,
                                         head.chunk_bytes_for(weight))
    return -loss, entropy, None, None, accuracy.bool() if accuracy is not None else None


class _EntropyGradient(torch.autograd.Function):
    """linear_cross_entropy's entropy has no gradient. This passes it through and, should a caller
    differentiate it (an entropy bonus), computes its gradient with linear_log_probs. Saving the inputs costs
    no memory: linear_cross_entropy keeps the same tensors for its own backward."""

    @staticmethod
    def forward(ctx, entropy, hidden, weight, bias, targets, options, chunk_bytes):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.options, ctx.chunk_bytes = options, chunk_bytes
        device = hidden.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        return entropy.clone()

    @staticmethod
    def backward(ctx, grad_entropy):
        if grad_entropy is None:
            return (None,) * 7
        hidden, weight, bias, targets = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(need) if t is not None else None
                  for t, need in zip((hidden, weight, bias), ctx.needs_input_grad[1:4])]
        device, dtype, enabled = ctx.autocast
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            entropy = llp.linear_log_probs(*inputs[:2], targets, inputs[2], **ctx.options, entropy=True,
                                           chunk_bytes=ctx.chunk_bytes).entropy
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(entropy, wanted, grad_entropy))
        dh, dw, db = (next(grads) if t is not None and t.requires_grad else None for t in inputs)
        return None, dh, dw, db, None, None, None


# the fused_linear_loss rule calls serve_trl_fused_head for every causal LM it patches
from foak.patching.replacements import FUSED_HEAD_HOOKS, LOGITS_LOSS_HOOKS, head_linears  # noqa: E402

if serve_trl_fused_head not in FUSED_HEAD_HOOKS:
    FUSED_HEAD_HOOKS.append(serve_trl_fused_head)
if watch_trl_fused_head not in LOGITS_LOSS_HOOKS:
    LOGITS_LOSS_HOOKS.append(watch_trl_fused_head)
