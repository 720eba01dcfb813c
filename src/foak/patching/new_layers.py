"""PEFT LoRA layers that appear after ``foak.patch``.

Users patch first and wrap later: ``foak.patch(model)`` then ``peft.get_peft_model(model, ...)``, TRL's
``SFTTrainer(model, peft_config=...)`` (which wraps the patched model itself) or transformers'
``model.add_adapter(...)``. The LoRA layers those add did not exist when the rules were applied. The patched
model's decoder stack therefore counts the PEFT LoRA layers the model holds at the start of each eager
forward (a walk over its modules, only once peft is imported) and, when the count changed, applies the
LoRA rules to the new layers (foak.patching.rules.extend: forwards already installed stay, the report's rows
are updated in place): they are fused from that forward on.

Which rules: with foak's defaults (``foak.patch(model)`` without a config, ``foak train``) the fused_lora
rules join; with a config that does not enable ``fused_lora``, the layers stay PEFT's and the report says so.
Not under torch.compile (tracing must not re-patch): run one eager forward, or patch after wrapping, before
compiling.
"""

from __future__ import annotations

import sys

from foak.patching.rules import RuleResult, extend

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
        model.__dict__[_SEEN] = count
        switches = self.switches | {LORA_SWITCH}
        if state.rules_source is None:
            raise RuntimeError("foak: PEFT LoRA layers appeared after patching, but the model was patched without a "
                               "rules source to fuse them from (foak.patching.apply(..., rules_source=...))")
        extend(model, [r for r in state.rules_source(model) if r.switch in switches])
        for row in report.results:
            if row.switch == LORA_SWITCH and row.modules:
                row.note_runtime("added", f"patched on the first forward after {count} PEFT LoRA layers appeared "
                                          "(after foak.patch)")
