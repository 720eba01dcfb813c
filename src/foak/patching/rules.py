"""The generic patching mechanism: rules, triggers, apply / restore and the report.

A :class:`Rule` says what happens to every module that matches its :class:`Trigger`: the module's
``forward`` is replaced by what the rule's ``patch`` function returns, installed on the instance and bound
to it (types.MethodType), so the class, every other model and every copy of the module stay right: a deep
copy of a patched module (PEFT's ``modules_to_save``) computes with its own parameters. ``patch`` may return
:class:`Skip` instead: the module stays as it is, and the reason is counted in the rule's report row.
``patch`` may also install something shared (a module global, a registry entry) through foak.patching.globals
and the :class:`PatchState` it receives, which undoes it on restore while nothing was installed over it.
Parameters, buffers and therefore ``state_dict()`` are never touched.

The :class:`PatchReport` tells what runs when it is read, not what ran when the model was patched: its
backend column comes from the dispatch setting (foak.backend) and the devices the model's parameters are
on at that moment, and a rule can add notes to its row at call time (:meth:`RuleResult.note_runtime`).
"""

from __future__ import annotations

import inspect
import types
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
class Rule:
    """``id`` is stable (``llama.rms_norm``); ``switch`` is the config switch that enables it (see
    foak.config: rms_norm, rope, swiglu, loss, fused_linear_loss, lora, moe, packed_attention).
    ``patch(module, model, state)`` returns the new forward of ``module`` as a function
    ``forward(self, *args, **kwargs)`` that reads the module as ``self`` (installed bound to the module, so a copy
    of the module computes with its own parameters; :func:`call_next` calls what it wraps), or :class:`Skip`
    to leave this module alone (with the reason). ``skip_reason(model)`` may explain why the rule does not apply to
    this model (reported, never silent). ``state.result`` is the rule's report row while ``patch`` runs: a
    replacement that keeps it can report what happens at call time with ``note_runtime``.
    ``describe(model)`` may add a patch-time note to the row once matching is done (e.g. which modules of
    the model the trigger left out, and why)."""

    id: str
    switch: str
    trigger: Trigger
    patch: Callable[[nn.Module, nn.Module, PatchState], Callable | Skip]
    skip_reason: Callable[[nn.Module], str | None] | None = None
    describe: Callable[[nn.Module], str | None] | None = None


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


class SharedAcrossCopies:
    """Mix-in for call-time state that a replacement forward shares with its rule (a report row's counts, a
    per-thread request): a copy of the patched module (``copy.deepcopy``, PEFT's ``modules_to_save``) keeps
    reporting to the same row rather than to a detached copy of it."""

    def __deepcopy__(self, memo):
        return self

    def __copy__(self):
        return self


class CallCounts(SharedAcrossCopies):
    """What really ran, call by call, shown in one rule's report row (subclasses: fused_lora's, fast_moe's, packed
    attention's; each formats its own note). One per (report, rule): :meth:`of` finds or makes it, and it lives
    as long as the report (which a re-patch after a deepcopy refills); :meth:`find` reads it. Calls made while
    torch.compile traces are not counted (``counting()``): a compiled graph's rows say so themselves."""

    def __init__(self, row):
        self.row = row

    @staticmethod
    def counting() -> bool:
        return not torch.compiler.is_compiling()

    @staticmethod
    def bump(counts: dict, key) -> None:
        counts[key] = counts.get(key, 0) + 1

    def show(self, text: str) -> None:
        self.row.note_runtime("calls", text)

    @classmethod
    def of(cls, state, rule_id: str, *args):
        key = (id(state.report), rule_id)
        counts = _CALL_COUNTS.get(key)
        if counts is None:
            counts = _CALL_COUNTS[key] = cls(state.result, *args)
            weakref.finalize(state.report, _CALL_COUNTS.pop, key, None)
        counts.row = state.result  # the current row of that report
        return counts

    @staticmethod
    def find(report, rule_id: str):
        return _CALL_COUNTS.get((id(report), rule_id))


_CALL_COUNTS: dict[tuple[int, str], CallCounts] = {}

# module.__dict__ key: {rule id: [what module.forward was before (None: the class's), active, the installed
# forward, the rule's function it calls while active]}
_LINKS = "_foak_forwards"


def _signature_with_self(forward: Callable) -> inspect.Signature | None:
    """The signature of a bound ``forward`` with a leading ``self``: what a function installed as a method in
    its place must declare so that ``inspect.signature`` of the bound method matches (HF Trainer reads it)."""
    try:
        signature = inspect.signature(forward)
    except (TypeError, ValueError):
        return None
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    return signature.replace(parameters=[self_parameter, *signature.parameters.values()])


def call_next(module: nn.Module, rule_id: str, *args, **kwargs):
    """Call the forward that the forward rule ``rule_id`` installed on ``module`` wraps: the instance forward that
    was there before it (another rule's, another library's), else the class's forward (called directly, which
    torch.compile traces on every torch foak supports)."""
    previous = module.__dict__[_LINKS][rule_id][0]
    if previous is not None:
        return previous(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


def at_trace_time(fn: Callable[[object], None]) -> None:
    """Call ``fn(ctx)`` while torch.compile (dynamo) traces the calling code, once per trace; nothing otherwise
    (call it under ``torch.compiler.is_compiling()``). For a report note on what compiled calls run. ``fn`` must
    be made outside the traced code (when the rule patches): dynamo skips a function made while it traces."""
    try:
        from torch._dynamo.comptime import comptime
    except ImportError:  # (a torch without dynamo's compile-time hook: no note)
        return
    comptime(fn)


def forward_link(module: nn.Module, rule_id: str) -> bool:
    """Whether ``module`` (or the module it was copied from) holds rule ``rule_id``'s forward, still active."""
    link = module.__dict__.get(_LINKS, {}).get(rule_id)
    return link is not None and link[1]


def install_forward(module: nn.Module, rule_id: str, function: Callable, below: tuple[str, ...] = ()) -> Callable:
    """Install ``function(self, *args, **kwargs)`` as ``module.forward``, bound to the module
    (types.MethodType): a deep copy of the module (PEFT's ``modules_to_save``, an EMA copy) gets it bound to
    the copy, computing with the copy's parameters. What ``module.forward`` was before is kept on the module
    (:func:`call_next`); the bound forward declares its signature (HF Trainer reads it). Returns the bound
    forward. ``function`` must not hold the module itself (a copy would compute with the original).
    ``below``: ids of foak rules whose forwards on this module must stay outside this one (a rule added to a
    patched model later, e.g. the LoRA q/k/v block inside the RoPE rule's cast): it is put under the innermost
    of them."""
    links = module.__dict__.setdefault(_LINKS, {})
    link = links.get(rule_id)
    if link is not None:
        if link[1]:
            raise ValueError(f"foak: {type(module).__name__} already holds the forward of rule {rule_id}")
        # restored while another library's forward wrapped foak's, now patched again: active again in place
        link[1], link[3] = True, function
        return module.forward
    outer = [links[r] for r in links if r in below]  # (in the order installed: the first is the innermost)
    previous = outer[0][0] if outer else module.__dict__.get("forward")
    signature = _signature_with_self(previous if previous is not None else types.MethodType(type(module).forward, module))

    def forward(self, *args, **kwargs):
        link = self.__dict__[_LINKS][rule_id]
        if link[1]:
            return link[3](self, *args, **kwargs)
        return call_next(self, rule_id, *args, **kwargs)  # restored while another forward wrapped it

    if signature is not None:
        forward.__signature__ = signature
    forward.__foak_rule__ = rule_id
    bound = types.MethodType(forward, module)
    if outer:
        outer[0][0] = bound
        links[rule_id] = [previous, True, forward, function]
        # keep the dict in chain order (innermost first), which uninstall_forwards walks backwards
        order = list(links)
        order.remove(rule_id)
        order.insert(order.index(next(r for r in order if links[r] is outer[0])), rule_id)
        module.__dict__[_LINKS] = {r: links[r] for r in order}
    else:
        links[rule_id] = [previous, True, forward, function]
        module.__dict__["forward"] = bound
    return bound


def uninstall_forwards(module: nn.Module) -> None:
    """Undo foak's forwards on ``module``, last installed first. Where another forward was installed over
    foak's after it (e.g. TRL's fused LM head), that one stays, and foak's underneath only passes calls on."""
    links = module.__dict__.get(_LINKS)
    if not links:
        return
    for rule_id in reversed(list(links)):
        previous, _, forward, _ = link = links[rule_id]
        current = module.__dict__.get("forward")
        if getattr(current, "__func__", None) is forward:
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = previous
            del links[rule_id]
        else:
            link[1] = False
    if not links:
        module.__dict__.pop(_LINKS, None)


class PatchState:
    """What restore() needs: the modules whose forwards were replaced and the module-global undo actions."""

    def __init__(self, report: PatchReport):
        self.report = report
        self.result: RuleResult | None = None  # the row of the rule being applied
        self.modules: list[nn.Module] = []  # modules given a forward (restore also finds copies of them)
        self.undo: list[Callable[[], None]] = []

    def set_forward(self, module: nn.Module, forward: Callable, below: tuple[str, ...] = ()) -> None:
        """Install ``forward(self, *args, **kwargs)`` as the module's forward for the rule being applied (see
        :func:`install_forward`)."""
        install_forward(module, self.result.rule_id, forward, below)
        self.modules.append(module)

    def on_restore(self, fn: Callable[[], None]) -> None:
        self.undo.append(fn)


def apply(model: nn.Module, rules: list[Rule], model_type: str = "", _report: PatchReport | None = None,
          watch=None, rules_source: Callable[[nn.Module], list[Rule]] | None = None) -> PatchReport:
    """Patch ``model`` in place with ``rules``; applying the same rules again is a no-op that returns the
    first report, applying different ones is an error (restore first).

    ``watch``: an object with ``start(model)``, ``changed(model) -> bool`` and ``update(model, state)``: at the
    start of each eager forward of the model's decoder stack (``model.base_model``: every way of running the
    model calls it, TRL's fused LM head too), ``update`` runs when ``changed`` says the model gained modules
    the rules should see (PEFT LoRA layers added after patching; foak.patching.new_layers), typically
    calling :func:`extend`.

    ``rules_source(model)``: every rule the model's patch may draw on, by id (foak.api's ``rules_of``: the
    architecture's rules and the optional ones the config added); the watch extends the patch from it, and a
    pickled patched model is patched again from it when it loads (a module-level function or a partial of one,
    pickled by reference). This mechanism knows no architecture: whoever applies rules names their source."""
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
    state.rules, state.model_type, state.watch, state.rules_source = [], model_type, watch, rules_source
    try:
        _apply_rules(model, state, rules, previous, {})
    except BaseException:
        _undo(state)
        raise
    if watch is not None:
        watch.start(model)
        stack = _decoder_stack(model)
        stack.__dict__[_WATCHED_BY] = weakref.ref(model)
        state.on_restore(stack.register_forward_pre_hook(_watch_hook).remove)
        state.on_restore(lambda: stack.__dict__.pop(_WATCHED_BY, None))
    object.__setattr__(model, _STATE_ATTR, state)  # a plain attribute: not a submodule, not in state_dict
    # a deepcopy (a TRL reference model, an EMA copy) gets its own patch: its own report, its own share of the
    # module globals, restorable on its own
    object.__setattr__(model, "__deepcopy__", _deepcopy_hook(model))
    # pickling (torch.save of the whole model) stores an unpatched copy and the rules' ids: it loads patched
    object.__setattr__(model, "__reduce_ex__", lambda protocol: _reduce_patched(model))
    return report


def extend(model: nn.Module, rules: list[Rule]) -> PatchReport:
    """Apply ``rules`` (the full ordered list the model should now be patched with: its current rules and new
    ones) to the modules of an already patched ``model`` that do not hold their forward yet, e.g. LoRA layers
    added after patching. Forwards already installed stay as they are (so a forward in progress is not
    disturbed), rows of rules already applied are updated in place, and a new rule's forward goes inside the
    forwards of rules that come after it in ``rules``."""
    state = model.__dict__[_STATE_ATTR]
    report = state.report
    rows = {r.rule_id: r for r in report.results}
    applied = {r.id for r in state.rules}
    keep = {rule_id: row for rule_id, row in rows.items() if rule_id in applied and row.modules}
    previous = {rule_id: row for rule_id, row in rows.items() if rule_id not in keep}
    others = [row for row in report.results if row.rule_id not in {r.id for r in rules}]
    report.results = []
    _apply_rules(model, state, rules, previous, keep)
    report.results.extend(others)
    return report


def _apply_rules(model, state: PatchState, rules: list[Rule], previous: dict, keep: dict) -> None:
    """apply / extend: patch the modules ``rules`` match that do not hold the rule's forward yet. ``keep``: rows
    of rules already applied, updated in place (their forwards report to them); ``previous``: earlier rows whose
    call-time notes carry over to the new ones."""
    report, named = state.report, list(model.named_modules())
    ids = [r.id for r in rules]
    for index, rule in enumerate(rules):
        reason = rule.skip_reason(model) if rule.skip_reason else None
        if reason:
            report.results.append(RuleResult(rule.id, rule.switch, 0, "-", f"not applied: {reason}"))
            continue
        result = keep.get(rule.id)
        if result is None:
            result = RuleResult(rule.id, rule.switch, 0, report.backend_text)
            if rule.id in previous:
                result.runtime.update(previous[rule.id].runtime)
        state.result = result
        below = tuple(ids[index + 1:])
        skipped: dict[tuple[str, str], int] = {}
        for name, module in named:
            if forward_link(module, rule.id) or not rule.trigger.matches(name, module, model):
                continue
            out = rule.patch(module, model, state)
            if isinstance(out, Skip):
                key = (type(module).__name__, out.reason)
                skipped[key] = skipped.get(key, 0) + 1
                continue
            if not callable(out):
                raise TypeError(f"rule {rule.id}: patch must return the new forward or Skip, got "
                                f"{type(out).__name__}")
            state.set_forward(module, out, below)
            result.modules += 1
        state.result = None
        if rule.id not in keep:
            notes = [f"{n} {cls} module{'s' if n > 1 else ''} not patched: {why}"
                     for (cls, why), n in sorted(skipped.items())]
            if not result.modules:
                result._backend = "-"
                if not skipped:
                    cls = rule.trigger.module_class
                    # (the class present but its predicate held for none: e.g. q/k/v not all LoRA layers)
                    present = sum(isinstance(m, cls) for _, m in named)
                    notes.insert(0, f"matched nothing ({present} {cls.__name__} module{'s' if present != 1 else ''}, "
                                    "none of which it applies to)" if present else
                                 f"matched nothing (no {cls.__name__} module)")
            result.note = "; ".join(notes)
            extra = rule.describe(model) if rule.describe else None
            if extra:
                result.note = f"{result.note}; {extra}" if result.note else extra
        report.results.append(result)
    state.rules = list(rules)


_WATCHED_BY = "_foak_watched_by"  # on the decoder stack: a weak reference to the patched model


def _decoder_stack(model: nn.Module) -> nn.Module:
    """The innermost ``base_model`` of ``model`` (a causal LM's decoder stack; through PEFT's wrappers too)."""
    module = model
    for _ in range(8):
        inner = getattr(module, "base_model", module)
        if not isinstance(inner, nn.Module) or inner is module:
            break
        module = inner
    return module


def restore(model: nn.Module) -> nn.Module:
    """Undo every patch of ``model``: foak's forwards on its modules (copies of patched modules inside it, e.g.
    PEFT's ``modules_to_save``, included) and what foak installed module-globally for it, where nothing was
    installed over it since. Also undoes the forwards of a module that holds copies of patched modules but was
    never patched itself. Returns ``model``."""
    for module in model.modules():  # the model, or the module foak patched inside it (a PEFT wrapper's base)
        state = module.__dict__.pop(_STATE_ATTR, None)
        if state is not None:
            module.__dict__.pop("__deepcopy__", None)
            module.__dict__.pop("__reduce_ex__", None)
            _undo(state)
    for module in model.modules():
        uninstall_forwards(module)
    return model


def _watch_hook(stack: nn.Module, args) -> None:
    """Forward pre-hook of a patched model's decoder stack: the model's ``watch`` (see :func:`apply`)."""
    if torch.compiler.is_compiling():  # (tracing must not re-patch: see foak.patching.new_layers)
        return
    owner = stack.__dict__.get(_WATCHED_BY)
    model = owner() if owner is not None else None
    state = model.__dict__.get(_STATE_ATTR) if model is not None else None
    if state is not None and state.watch is not None and _decoder_stack(model) is stack and \
            state.watch.changed(model):
        state.watch.update(model, state)


def _deepcopy_hook(model: nn.Module):
    """The patched model's ``__deepcopy__``. A wrapper whose ``__getattr__`` forwards unknown names to the module
    inside it (PEFT's PeftModel and LoraModel, when foak patched the model before or after get_peft_model wrapped
    it) hands ``copy.deepcopy`` this hook for ITSELF: without the check the copy of a PeftModel was a copy of the
    causal LM inside it. The object being copied is copy.deepcopy's ``x``; a wrapper gets the default deepcopy
    (its attributes, this model among them, are copied as usual)."""
    import copy
    import copyreg
    import sys

    def __deepcopy__(memo):
        caller = sys._getframe(1)
        x = caller.f_locals.get("x", model) if caller.f_code is copy.deepcopy.__code__ else model
        if x is model:
            return _deepcopy_patched(model, memo)
        reductor = copyreg.dispatch_table.get(type(x))
        return copy._reconstruct(x, memo, *(reductor(x) if reductor is not None else x.__reduce_ex__(4)))

    return __deepcopy__


def _deepcopy_patched(model: nn.Module, memo: dict) -> nn.Module:
    """deepcopy of a patched model: copy the unpatched model, then patch the copy (and the original again)
    with the same rules."""
    state = model.__dict__[_STATE_ATTR]
    clone = _unpatched_copy(model, memo)
    apply(clone, state.rules, state.model_type, watch=state.watch, rules_source=state.rules_source)
    return clone


def _unpatched_copy(model: nn.Module, memo: dict | None = None) -> nn.Module:
    import copy

    state = model.__dict__[_STATE_ATTR]
    rules, model_type, report, watch = state.rules, state.model_type, state.report, state.watch
    rules_source = state.rules_source
    restore(model)
    try:
        return copy.deepcopy(model, memo)
    finally:
        apply(model, rules, model_type, _report=report, watch=watch,  # the report the user holds stays live
              rules_source=rules_source)


def _reduce_patched(model: nn.Module):
    """Pickle a patched model as an unpatched copy (the whole model is copied once, transiently) and the ids of
    the rules it is patched with; unpickling patches it again with the rules of its architecture."""
    state = model.__dict__[_STATE_ATTR]
    return _unpickle_patched, (_unpatched_copy(model), [r.id for r in state.rules], state.model_type, state.watch,
                               state.rules_source)


def _unpickle_patched(model: nn.Module, rule_ids: list[str], model_type: str, watch,
                      rules_source=None) -> nn.Module:
    if rules_source is None:
        raise ValueError("foak: this pickled model was patched without a rules source (foak.patching.apply with "
                         "rules_source=None), so its rules cannot be found again: pickle it unpatched "
                         "(foak.restore) and patch it after loading")
    by_id = {r.id: r for r in rules_source(model)}
    missing = [i for i in rule_ids if i not in by_id]
    if missing:
        raise ValueError(f"foak: the pickled model was patched with rules this foak does not have: {missing}")
    apply(model, [by_id[i] for i in rule_ids], model_type, watch=watch, rules_source=rules_source)
    return model


def is_patched(model: nn.Module) -> bool:
    """Whether ``model``, or a module inside it (the base model of a PEFT wrapper built after patching), is
    patched by foak."""
    return any(_STATE_ATTR in m.__dict__ for m in model.modules())


def _undo(state: PatchState) -> None:
    for module in reversed(state.modules):
        uninstall_forwards(module)
    for fn in reversed(state.undo):
        fn()
    state.modules.clear()
    state.undo.clear()
