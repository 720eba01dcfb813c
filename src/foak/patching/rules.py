"""The generic patching mechanism: rules, triggers, apply / restore and the report.

A :class:`Rule` says what happens to every module that matches its :class:`Trigger`. Two kinds:

- ``kind="forward"``: the module's ``forward`` is replaced by what the rule's ``patch`` function returns
  (an instance attribute, so the class and every other model stay untouched);
- ``kind="implementation"``: the module already dispatches at call time on a setting it reads (e.g.
  transformers' experts modules on ``config._experts_implementation``); ``patch`` returns a
  :class:`Selection` (set this attribute of that object to this value), which apply sets once per object
  and restore puts back exactly as it was.

For either kind ``patch`` may return :class:`Skip` instead: the module stays as it is, and the reason is
counted in the rule's report row. ``patch`` may also install something module-global through the
:class:`PatchState` it receives, which undoes it on restore. Parameters, buffers and therefore
``state_dict()`` are never touched.

The :class:`PatchReport` tells what runs when it is read, not what ran when the model was patched: its
backend column comes from the dispatch setting (foak.backend) and the devices the model's parameters are
on at that moment, and a rule can add notes to its row at call time (:meth:`RuleResult.note_runtime`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from foak import backend as _backend

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
class Skip:
    """Returned by a Rule's ``patch`` to leave one matched module as it is; ``reason`` is counted in the
    rule's report row ("1 GraniteMoeExperts module not patched: expert biases"), never silent."""

    reason: str


@dataclass(frozen=True)
class Selection:
    """Returned by the ``patch`` of a ``kind="implementation"`` rule: set ``target.<attribute>`` to
    ``value`` (e.g. the implementation name on the config a module reads it from). Several modules may
    select the same value on one shared target: it is set once, and restore puts back what was there (the
    previous instance value, or no instance attribute at all). Two different values for one target are an
    error. ``label`` names the setting in the report row (default: the attribute's name)."""

    target: object
    attribute: str
    value: object
    label: str | None = None


RULE_KINDS = ("forward", "implementation")


@dataclass(frozen=True)
class Rule:
    """``id`` is stable (``llama.rms_norm``); ``switch`` is the config switch that enables it (see
    foak.config: rms_norm, rope, swiglu, loss, fused_linear_loss, lora, moe, packed_attention).
    ``patch(module, model, state)`` returns, for ``kind="forward"``, the new forward of ``module``; for
    ``kind="implementation"``, the :class:`Selection` that makes the module run foak's implementation (it may
    also replace forwards through ``state.set_forward``); for either, :class:`Skip` to leave
    this module alone (with the reason). ``skip_reason(model)`` may explain why the rule does not apply to
    this model (reported, never silent). ``state.result`` is the rule's report row while ``patch`` runs: a
    replacement that keeps it can report what happens at call time with ``note_runtime``.
    ``describe(model)`` may add a patch-time note to the row once matching is done (e.g. which modules of
    the model the trigger left out, and why)."""

    id: str
    switch: str
    trigger: Trigger
    patch: Callable[[nn.Module, nn.Module, PatchState], Callable | Selection | Skip]
    skip_reason: Callable[[nn.Module], str | None] | None = None
    describe: Callable[[nn.Module], str | None] | None = None
    kind: str = "forward"

    def __post_init__(self):
        if self.kind not in RULE_KINDS:
            raise ValueError(f"Rule {self.id}: kind must be one of {RULE_KINDS}, got {self.kind!r}")


class RuleResult:
    """One row of the report. ``backend`` is a fixed text ("-" for a rule that patched nothing) or, for
    a rule that patched something, what runs its ops now (read when asked). ``note`` is said at patch time;
    ``runtime`` holds the notes a rule adds while the model runs (see :meth:`note_runtime`)."""

    def __init__(self, rule_id: str, switch: str, modules: int, backend: str | Callable[[], str] = "-",
                 note: str = ""):
        self.rule_id, self.switch, self.modules, self.note = rule_id, switch, modules, note
        self._backend = backend
        self.runtime: dict[str, str] = {}

    @property
    def backend(self) -> str:
        return self._backend() if callable(self._backend) else self._backend

    def note_runtime(self, key: str, text: str | None) -> None:
        """Set (or with ``None`` remove) the call-time note ``key`` of this row, e.g.
        ``note_runtime("stepped_aside", "stepped aside in 2 of 5 forwards: ...")``. One note per key:
        a rule that reports a running count calls it again with the same key."""
        if text is None:
            self.runtime.pop(key, None)
        else:
            self.runtime[key] = text

    @property
    def notes(self) -> str:
        """The patch-time note and the call-time notes, as the report prints them."""
        return "; ".join(t for t in (self.note, *self.runtime.values()) if t)

    def __repr__(self) -> str:
        return (f"RuleResult({self.rule_id!r}, {self.switch!r}, {self.modules}, backend={self.backend!r}, "
                f"notes={self.notes!r})")


@dataclass
class PatchReport:
    """Per rule: how many modules it patched, what runs them, and notes (why it patched nothing; what it
    did at call time). Read it (``str(report)``, ``result.backend``) when you want to know: nothing in
    it is frozen at patch time."""

    model_type: str
    results: list[RuleResult] = field(default_factory=list)
    _model: Callable[[], nn.Module | None] | None = field(default=None, repr=False, compare=False)

    def count(self, rule_id: str) -> int:
        return next(r.modules for r in self.results if r.rule_id == rule_id)

    def result(self, rule_id: str) -> RuleResult:
        return next(r for r in self.results if r.rule_id == rule_id)

    def devices(self) -> list[torch.device]:
        """The device types the patched model's parameters are on now (empty if it is gone or has none)."""
        model = self._model() if self._model is not None else None
        types = [] if model is None else list(dict.fromkeys(p.device.type for p in model.parameters()))
        return [torch.device(t) for t in types]

    def backend_text(self) -> str:
        """What runs the patched ops now: per device the model is on (``foak.backend.runs_on``), else the
        dispatch policy."""
        devices = self.devices()
        return ", ".join(_backend.runs_on(d) for d in devices) if devices else _backend.policy()

    def __str__(self) -> str:
        header = ("rule", "switch", "modules", "backend", "note")
        rows = [(r.rule_id, r.switch, str(r.modules), r.backend, r.notes) for r in self.results]
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        lines = [f"foak patch report ({self.model_type}; backend setting {_backend.policy()})"]
        for row in [header, *rows]:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        return "\n".join(lines)

    def __getstate__(self):  # picklable: the weak reference to the model is not kept
        return {**self.__dict__, "_model": None}


class PatchState:
    """What restore() needs: the instance forwards replaced and the module-global undo actions."""

    def __init__(self, report: PatchReport):
        self.report = report
        self.result: RuleResult | None = None  # the row of the rule being applied
        self.forwards: list[tuple[nn.Module, object]] = []  # (module, previous instance forward or _MISSING)
        self.undo: list[Callable[[], None]] = []
        # (id(target), attribute) -> (target, value set, value before): the Selections made so far
        self.selected: dict[tuple[int, str], tuple[object, object, object]] = {}

    def set_forward(self, module: nn.Module, forward: Callable) -> None:
        self.forwards.append((module, module.__dict__.get("forward", _MISSING)))
        module.forward = forward

    def on_restore(self, fn: Callable[[], None]) -> None:
        self.undo.append(fn)

    def previous_value(self, target: object, attribute: str, default=None):
        """``target.<attribute>`` as it was before this patch set it (its current value if it did not)."""
        entry = self.selected.get((id(target), attribute))
        if entry is not None:
            return default if entry[2] is _MISSING else entry[2]
        return getattr(target, attribute, default)

    def set_attribute(self, target: object, attribute: str, value: object) -> bool:
        """Set ``target.<attribute> = value`` until restore (see :class:`Selection`); False if this patch had
        already set it to that value."""
        key = (id(target), attribute)
        entry = self.selected.get(key)
        if entry is not None:
            if entry[1] != value:
                raise ValueError(f"foak: two rules set {type(target).__name__}.{attribute} to {entry[1]!r} and "
                                 f"{value!r}; they cannot both apply")
            return False
        if hasattr(getattr(type(target), attribute, None), "__set__"):  # a property: set back through it
            previous = getattr(target, attribute)
            self.selected[key] = (target, value, previous)
            setattr(target, attribute, value)
            self.undo.append(lambda: setattr(target, attribute, previous))
            return True
        own = vars(target)
        previous = own.get(attribute, _MISSING)
        self.selected[key] = (target, value, previous if previous is not _MISSING else getattr(target, attribute,
                                                                                               _MISSING))
        setattr(target, attribute, value)

        def undo():
            if previous is _MISSING:
                own.pop(attribute, None)  # the class attribute (or its absence) shows again
            else:
                own[attribute] = previous

        self.undo.append(undo)
        return True


_MISSING = object()


def apply(model: nn.Module, rules: list[Rule], model_type: str = "", _report: PatchReport | None = None
          ) -> PatchReport:
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
    # _report: re-patching a model (after a deepcopy) refills the report its user already holds
    report = PatchReport(model_type or type(model).__name__) if _report is None else _report
    previous = {r.rule_id: r for r in report.results}
    report.results = []
    report._model = weakref.ref(model)
    state = PatchState(report)
    named = list(model.named_modules())
    try:
        for rule in rules:
            reason = rule.skip_reason(model) if rule.skip_reason else None
            if reason:
                report.results.append(RuleResult(rule.id, rule.switch, 0, "-", f"not applied: {reason}"))
                continue
            result = state.result = RuleResult(rule.id, rule.switch, 0, report.backend_text)
            if rule.id in previous:
                result.runtime.update(previous[rule.id].runtime)
            skipped: dict[tuple[str, str], int] = {}
            selections: dict[tuple[str, object, object], int] = {}
            for name, module in named:
                if rule.trigger.matches(name, module, model):
                    out = rule.patch(module, model, state)
                    if isinstance(out, Skip):
                        key = (type(module).__name__, out.reason)
                        skipped[key] = skipped.get(key, 0) + 1
                        continue
                    if rule.kind == "implementation":
                        if not isinstance(out, Selection):
                            raise TypeError(f"rule {rule.id}: patch must return a Selection or Skip, got "
                                            f"{type(out).__name__}")
                        before = state.previous_value(out.target, out.attribute)
                        if state.set_attribute(out.target, out.attribute, out.value):
                            key = (out.label or out.attribute, before, out.value)
                            selections[key] = selections.get(key, 0) + 1
                    else:
                        if not callable(out):
                            raise TypeError(f"rule {rule.id}: patch must return the new forward or Skip, got "
                                            f"{type(out).__name__}")
                        state.set_forward(module, out)
                    result.modules += 1
            state.result = None
            notes = [f"{label}: {before!r} -> {value!r}" + (f" on {n} objects" if n > 1 else "")
                     for (label, before, value), n in selections.items()]
            notes += [f"{n} {cls} module{'s' if n > 1 else ''} not patched: {why}"
                      for (cls, why), n in sorted(skipped.items())]
            if not result.modules:
                result._backend = "-"
                if not skipped:
                    notes.insert(0, f"matched nothing (no {rule.trigger.module_class.__name__} module)")
            result.note = "; ".join(notes)
            extra = rule.describe(model) if rule.describe else None
            if extra:
                result.note = f"{result.note}; {extra}" if result.note else extra
            report.results.append(result)
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
    rules, model_type, report = state.rules, state.model_type, state.report
    restore(model)
    try:
        clone = copy.deepcopy(model, memo)
    finally:
        apply(model, rules, model_type, _report=report)  # the report the user holds stays the live one
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
    state.selected.clear()
