"""TRL's distillation loss served by foak's linear_jsd.

TRL's ``DistillationTrainer`` (TRL 1.x) runs both backbones, then scores the student against the teacher with
the module global ``trl.trainer.distillation_trainer._chunked_divergence_loss(student_hidden_states,
teacher_hidden_states, student_lm_head_weight, teacher_lm_head_weight, completion_mask, beta,
num_items_in_batch, student_lm_head_bias, teacher_lm_head_bias, student/teacher_logit_scale,
student/teacher_final_logit_softcapping, temperature)``, which returns ``(loss, entropy_sum, n_valid)``: the
generalized JSD (0 < beta < 1), forward KL (beta = 0) or reverse KL (beta = 1) summed over the completion
tokens and divided by their count (or by ``num_items_in_batch``), the student's summed entropy and the token
count. The student's lm_head and loss_function never run, so foak's fused_linear_loss rule would not act.

While a model patched with fused_linear_loss is alive, that global is a stand-in which computes the loss with
foak's ``linear_jsd`` when the student's ``lm_head`` weight is such a model's (or a PEFT modules_to_save copy's)
and foak can express the call, and hands it to TRL's own function otherwise, writing why into the rule's report
row (and warning once). A student foak did not patch always gets TRL's function. The stand-in is installed once
per process (when TRL's distillation module is imported after foak.patch, by an import hook as it loads),
ref-counted, and restored when the last patched model is restored or garbage-collected.
"""

from __future__ import annotations

import inspect
import sys
import threading
import warnings
import weakref

import torch

import foak.ops.linear_jsd as jsd  # called through the module (tests count the calls)
from foak.patching import globals as shared_globals

_MODULE, _GLOBAL = "trl.trainer.distillation_trainer", "_chunked_divergence_loss"
_KEY = ("trl", _MODULE, _GLOBAL)
# the stand-in's arguments (TRL 1.16's): anything else TRL passes with a non-default value goes to TRL
_KNOWN = {"student_hidden_states", "teacher_hidden_states", "student_lm_head_weight", "teacher_lm_head_weight",
          "completion_mask", "beta", "num_items_in_batch", "student_lm_head_bias", "teacher_lm_head_bias",
          "student_logit_scale", "teacher_logit_scale", "student_final_logit_softcapping",
          "teacher_final_logit_softcapping", "temperature"}
_NOTE = "trl distillation"

_lock = threading.Lock()
_students: dict[int, _Student] = {}  # id(_Student) -> _Student, one per patched causal LM


class _Student:
    """A patched model's lm_head and the report row (RuleResult) that tells what became of its TRL calls."""

    def __init__(self, causal_lm, result):
        self.module = weakref.ref(causal_lm.lm_head)
        self.causal_lm = weakref.ref(causal_lm)
        self.result = result
        self.served = 0
        self.fallbacks: dict[str, int] = {}  # reason -> calls

    def owns(self, module, weight) -> bool:
        """Whether ``weight`` is this student's head's: the patched lm_head's, or that of a trainable copy PEFT made
        of it after foak.patch (``modules_to_save=["lm_head"]``: TRL passes the active copy's weight)."""
        if module.weight is weight:
            return True
        causal_lm = self.causal_lm()
        return causal_lm is not None and any(
            linear.weight is weight for linear in head_linears(getattr(causal_lm, "lm_head", None)))

    def count_served(self) -> None:
        self.served += 1
        self.result.note_runtime(_NOTE, f"served TRL's distillation loss ({_calls(self.served)})")

    def count_fallback(self, reason: str) -> None:
        calls = self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        self.result.note_runtime(f"{_NOTE}: {reason}", f"TRL's own distillation loss ran {_calls(calls)}: {reason}")
        if calls == 1:
            warnings.warn(f"foak {self.result.rule_id}: TRL's own distillation loss runs: {reason}", stacklevel=4)


def _calls(n: int) -> str:
    return f"{n} call" if n == 1 else f"{n} calls"


def serve_trl_distillation(causal_lm, state, chunk_bytes=None) -> None:
    """Called by the fused_linear_loss rule for each causal LM it patches (``state.result`` is its report row):
    from now until ``state`` is restored, or the lm_head is garbage-collected, TRL's distillation loss with this
    model as the student runs foak's linear_jsd, whether TRL is imported before or after."""
    lm_head = causal_lm.lm_head
    student = _Student(causal_lm, state.result)
    with _lock:
        _students[id(student)] = student
    state.on_restore(weakref.finalize(lm_head, _forget, id(student)))
    shared_globals.acquire_for(lm_head, state, _KEY, _install)


def _forget(key: int) -> None:
    with _lock:
        _students.pop(key, None)


def _install():
    """Put the stand-in into TRL's distillation module now, or as soon as it is imported; returns the undo."""
    module = sys.modules.get(_MODULE)
    if module is not None:
        return _replace(module)
    hook = _ImportHook()
    sys.meta_path.insert(0, hook)

    def undo():
        if hook in sys.meta_path:
            sys.meta_path.remove(hook)
        if hook.undo is not None:
            hook.undo()

    return undo


def _replace(module):
    original = getattr(module, _GLOBAL, None)
    if not callable(original) or isinstance(original, _FoakDivergenceLoss):
        return lambda: None  # a TRL without the chunked loss (nothing to serve), or foak's already
    return shared_globals.replace_attribute(module, _GLOBAL, _FoakDivergenceLoss(original))


class _ImportHook:
    """A sys.meta_path finder for a TRL distillation module imported after foak.patch: the stand-in goes in as
    soon as the module has been executed (before any trainer exists)."""

    def __init__(self):
        self.undo = None

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _MODULE:
            return None
        for finder in list(sys.meta_path):
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if hasattr(spec.loader, "exec_module"):
                        spec.loader = _ThenReplace(spec.loader, self)
                    return spec
        return None


class _ThenReplace:
    """The module's own loader, then the stand-in."""

    def __init__(self, loader, hook):
        self._loader, self._hook = loader, hook

    def __getattr__(self, name):  # get_source, get_resource_reader, ...: the wrapped loader's
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        if self._hook in sys.meta_path:  # (still wanted: a patched model is alive)
            sys.meta_path.remove(self._hook)
            self._hook.undo = _replace(module)


def _student_of(weight) -> _Student | None:
    with _lock:
        students = [(s, s.module()) for s in _students.values()]
    for student, module in students:
        if module is not None and student.owns(module, weight):
            return student
    return None


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


def _cannot_serve(a: dict) -> str | None:
    """Why foak cannot compute this call (None: it can). ``a``: TRL's arguments by name."""
    hs, ht = a["student_hidden_states"], a["teacher_hidden_states"]
    ws, wt = a["student_lm_head_weight"], a["teacher_lm_head_weight"]
    bs, bt = a["student_lm_head_bias"], a["teacher_lm_head_bias"]
    if any(_is_dtensor(t) for t in (ws, wt, bs, bt)):
        return "an lm_head sharded as a DTensor (FSDP2): TRL gathers it itself"
    if any(hasattr(t, "ds_id") for t in (ws, wt)):
        return "an lm_head partitioned by DeepSpeed ZeRO-3"
    beta, temperature = a["beta"], a["temperature"]
    if not (isinstance(beta, (int, float)) and 0 <= beta <= 1) or not (
            isinstance(temperature, (int, float)) and temperature > 0):
        return f"beta={beta!r}, temperature={temperature!r} (foak needs 0 <= beta <= 1 and temperature > 0)"
    for who in ("student", "teacher"):
        scale, cap = a[f"{who}_logit_scale"], a[f"{who}_final_logit_softcapping"]
        if not isinstance(scale, (int, float)) or scale == 0 or (cap is not None and not cap > 0):
            return f"{who} logit scale {scale!r} / softcap {cap!r} (foak needs a non-zero scale and a cap > 0)"
    if ws.shape[0] != wt.shape[0]:
        return f"student and teacher vocabularies differ ({ws.shape[0]} vs {wt.shape[0]})"
    if hs.shape[:-1] != ht.shape[:-1] or a["completion_mask"].shape != hs.shape[:-1]:
        return (f"hidden states {tuple(hs.shape)} / {tuple(ht.shape)} and completion mask "
                f"{tuple(a['completion_mask'].shape)} do not line up")
    if not torch.is_autocast_enabled(hs.device.type):
        for who, h, w, b in (("student", hs, ws, bs), ("teacher", ht, wt, bt)):
            if h.dtype != w.dtype or (b is not None and b.dtype != w.dtype):
                return f"{who}: {h.dtype} hidden states and a {w.dtype} lm_head outside autocast"
    return None


class _FoakDivergenceLoss:
    """Stands in for ``trl.trainer.distillation_trainer._chunked_divergence_loss``."""

    def __init__(self, original):
        self.original = original
        self.signature = inspect.signature(original)

    def __call__(self, *args, **kwargs):
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:  # a TRL whose callers pass what its loss's signature does not take
            student = next((s for s in map(_student_of, (*args, *kwargs.values())) if s is not None), None)
            if student is not None:
                student.count_fallback(f"arguments foak cannot bind to TRL's loss ({e})")
            return self.original(*args, **kwargs)
        student = _student_of(bound.arguments.get("student_lm_head_weight"))
        if student is None:  # a student foak did not patch
            return self.original(*args, **kwargs)
        defaults = {k: p.default for k, p in self.signature.parameters.items()}
        unknown = sorted(k for k, v in bound.arguments.items() if k not in _KNOWN and v is not defaults[k])
        bound.apply_defaults()
        a = bound.arguments
        reason = (f"arguments foak does not know: {unknown}" if unknown
                  else "a TRL whose loss takes other arguments" if not _KNOWN <= set(a) else _cannot_serve(a))
        if reason:
            student.count_fallback(reason)
            return self.original(*args, **kwargs)
        mask = a["completion_mask"].to(a["student_hidden_states"].device)
        loss, entropy = jsd.linear_jsd(
            a["student_hidden_states"], a["student_lm_head_weight"], a["teacher_hidden_states"],
            a["teacher_lm_head_weight"], a["student_lm_head_bias"], a["teacher_lm_head_bias"], beta=a["beta"],
            temperature=a["temperature"], student_logit_scale=a["student_logit_scale"],
            teacher_logit_scale=a["teacher_logit_scale"], student_softcap=a["student_final_logit_softcapping"],
            teacher_softcap=a["teacher_final_logit_softcapping"], mask=mask, reduction="mean",
            num_items_in_batch=a["num_items_in_batch"], return_entropy=True)
        n_valid = (mask != 0).sum()
        student.count_served()
        return loss, entropy * n_valid, n_valid  # (the entropy is a mean over the valid tokens)


# the fused_linear_loss rule calls serve_trl_distillation for every causal LM it patches
from foak.patching.replacements import FUSED_HEAD_HOOKS, head_linears  # noqa: E402

if serve_trl_distillation not in FUSED_HEAD_HOOKS:
    FUSED_HEAD_HOOKS.append(serve_trl_distillation)
