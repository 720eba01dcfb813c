"""The generic patching mechanism: rules, triggers, apply / restore and the report.

A :class:`Rule` says: every module that matches its :class:`Trigger` gets its ``forward`` replaced by what
the rule's ``patch`` function returns (an instance attribute, so the class and every other model stay
untouched). ``patch`` may also install something module-global through the :class:`PatchState` it
receives, which undoes it on restore. Parameters, buffers and therefore ``state_dict()`` are never touched.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from foak.backend import describe

_STATE_ATTR = "_foak_patch_state"


@dataclass(frozen=True)
class Trigger:
    """Which modules a rule applies to: an instance of ``module_class``, optionally only when reached
    through an attribute called ``attribute`` of its parent, and when ``predicate(module, model)`` holds."""

    module_class: type
    attribute: str | None = None
    predicate: Callable[[nn.Module, nn.Module], bool] | None = None

    def matches(self, name: str, module: nn.Module, model: nn.Module) -> bool:
        if not isinstance(module, self.module_class):
            return False
        if self.attribute is not None and name.rsplit(".", 1)[-1] != self.attribute:
            return False
        return self.predicate is None or bool(self.predicate(module, model))


@dataclass(frozen=True)
class Rule:
    """``id`` is stable (``llama.rms_norm``); ``switch`` is the config switch that enables it (see
    foak.config: rms_norm, rope, swiglu, loss, fused_linear_loss). ``patch(module, model, state)`` returns
    the new forward of ``module``. ``skip_reason(model)`` may explain why the rule does not apply to this
    model (reported, never silent)."""

    id: str
    switch: str
    trigger: Trigger
    patch: Callable[[nn.Module, nn.Module, PatchState], Callable]
    skip_reason: Callable[[nn.Module], str | None] | None = None


@dataclass
class RuleResult:
    rule_id: str
    switch: str
    modules: int
    backend: str
    note: str = ""


@dataclass
class PatchReport:
    """Per rule: how many modules it patched, which backend runs them, and a note when it patched none."""

    model_type: str
    results: list[RuleResult] = field(default_factory=list)

    def count(self, rule_id: str) -> int:
        return next(r.modules for r in self.results if r.rule_id == rule_id)

    def __str__(self) -> str:
        header = ("rule", "switch", "modules", "backend", "note")
        rows = [(r.rule_id, r.switch, str(r.modules), r.backend, r.note) for r in self.results]
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines = [f"foak patch report ({self.model_type})"]
        for row in [header, *rows]:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        return "\n".join(lines)


class PatchState:
    """What restore() needs: the instance forwards replaced and the module-global undo actions."""

    def __init__(self, report: PatchReport):
        self.report = report
        self.forwards: list[tuple[nn.Module, object]] = []  # (module, previous instance forward or _MISSING)
        self.undo: list[Callable[[], None]] = []

    def set_forward(self, module: nn.Module, forward: Callable) -> None:
        self.forwards.append((module, module.__dict__.get("forward", _MISSING)))
        module.forward = forward

    def on_restore(self, fn: Callable[[], None]) -> None:
        self.undo.append(fn)


_MISSING = object()


def apply(model: nn.Module, rules: list[Rule], model_type: str = "") -> PatchReport:
    """Patch ``model`` in place with ``rules``; applying the same rules again is a no-op that returns the
    first report, applying different ones is an error (restore first)."""
    state = model.__dict__.get(_STATE_ATTR)
    if state is not None:
        if [r.id for r in state.rules] != [r.id for r in rules]:
            raise ValueError(
                f"model is already patched with {[r.id for r in state.rules]}; call foak.restore(model) before "
                f"patching it with a different set of rules ({[r.id for r in rules]})"
            )
        return state.report
    report = PatchReport(model_type or type(model).__name__)
    state = PatchState(report)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    backend = describe(device)
    named = list(model.named_modules())
    try:
        for rule in rules:
            reason = rule.skip_reason(model) if rule.skip_reason else None
            if reason:
                report.results.append(RuleResult(rule.id, rule.switch, 0, "-", f"not applied: {reason}"))
                continue
            count = 0
            for name, module in named:
                if rule.trigger.matches(name, module, model):
                    state.set_forward(module, rule.patch(module, model, state))
                    count += 1
            note = "" if count else f"matched nothing (no {rule.trigger.module_class.__name__} module)"
            report.results.append(RuleResult(rule.id, rule.switch, count, backend if count else "-", note))
    except BaseException:
        _undo(state)
        raise
    state.rules, state.model_type = list(rules), model_type
    object.__setattr__(model, _STATE_ATTR, state)  # a plain attribute: not a submodule, not in state_dict
    # the replacement forwards close over this model's modules: a deepcopy (a TRL reference model, an EMA
    # copy) must get its own patch, not share ours
    object.__setattr__(model, "__deepcopy__", lambda memo: _deepcopy_patched(model, memo))
    return report


def restore(model: nn.Module) -> nn.Module:
    """Undo every patch of ``model`` (a model that was never patched is returned unchanged)."""
    state = model.__dict__.pop(_STATE_ATTR, None)
    if state is not None:
        model.__dict__.pop("__deepcopy__", None)
        _undo(state)
    return model


def _deepcopy_patched(model: nn.Module, memo: dict) -> nn.Module:
    """deepcopy of a patched model: copy the unpatched model, then patch the copy (and the original again)
    with the same rules."""
    import copy

    state = model.__dict__[_STATE_ATTR]
    rules, model_type = state.rules, state.model_type
    restore(model)
    try:
        clone = copy.deepcopy(model, memo)
    finally:
        apply(model, rules, model_type)
    apply(clone, rules, model_type)
    return clone


def is_patched(model: nn.Module) -> bool:
    return _STATE_ATTR in model.__dict__


def _undo(state: PatchState) -> None:
    for module, previous in reversed(state.forwards):
        if previous is _MISSING:
            module.__dict__.pop("forward", None)
        else:
            module.forward = previous
    for fn in reversed(state.undo):
        fn()
    state.forwards.clear()
    state.undo.clear()
