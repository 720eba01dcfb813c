"""PEFT LoRA layers that appear after ``foak.patch``.

Users patch first and wrap later: ``foak.patch(model)`` then ``peft.get_peft_model(model, ...)``, TRL's
``SFTTrainer(model, peft_config=...)`` (which wraps the patched model itself) or transformers'
``model.add_adapter(...)``. The LoRA layers those add did not exist when the rules were applied. The patched
model's forward therefore counts the PEFT LoRA layers it holds before each eager forward (a walk over its
modules, only once peft is imported) and, when the count changed, applies its rules again, LoRA rules
included: the layers are fused from that forward on, and the report (the same object) gains their rows.

Which rules: with foak's defaults (``foak.patch(model)`` without a config, ``foak train``) the fused_lora
rules join; with a config that does not enable ``fused_lora``, the layers stay PEFT's and the report says so.
Not under torch.compile (tracing must not re-patch): run one eager forward, or patch after wrapping, before
compiling.
"""

from __future__ import annotations

import sys

from foak.patching.rules import RuleResult, apply, restore

_SEEN = "_foak_lora_layers_seen"
LORA_SWITCH = "lora"


def _lora_layers(model) -> int:
    layer = sys.modules.get("peft.tuners.lora.layer")
    if layer is None:
        return 0
    return sum(1 for m in model.modules() if isinstance(m, layer.LoraLayer))


class NewLoraLayers:
    """The ``watch`` of foak.patching.rules.apply for LoRA layers added later. ``switches``: the rule switches the
    model was patched with; ``fuse``: whether LoRA layers that appear are fused (foak's defaults) or only
    reported (a config without ``fused_lora``). Holds no per-model state (a deepcopy of the model shares it)."""

    def __init__(self, switches, fuse: bool):
        self.switches, self.fuse = frozenset(switches), fuse

    def start(self, model) -> None:
        model.__dict__[_SEEN] = _lora_layers(model)

    def changed(self, model) -> bool:
        return "peft.tuners.lora.layer" in sys.modules and _lora_layers(model) != model.__dict__.get(_SEEN, 0)

    def update(self, model, state) -> None:
        from foak.models import rules_for

        count = _lora_layers(model)
        report = state.report
        if not self.fuse:
            model.__dict__[_SEEN] = count
            row = next((r for r in report.results if r.switch == LORA_SWITCH), None)
            if row is None:
                row = RuleResult(f"{report.model_type}.fused_lora", LORA_SWITCH, 0, "-")
                report.results.append(row)
            row.note_runtime("added", f"{count} PEFT LoRA layers appeared after foak.patch; fused_lora is off in "
                                      "this config, so PEFT's forward runs them (enable fused_lora in the peft "
                                      "stanza, or patch with foak's defaults)")
            return
        switches = self.switches | {LORA_SWITCH}
        rules = [r for r in rules_for(model) if r.switch in switches]
        restore(model)
        apply(model, rules, state.model_type, _report=report, watch=NewLoraLayers(switches, True))
        for row in report.results:
            if row.switch == LORA_SWITCH and row.modules:
                row.note_runtime("added", f"patched on the first forward after {count} PEFT LoRA layers appeared "
                                          "(after foak.patch)")
