"""Patching: the generic mechanism (rules.py: triggers, rules, the report, restore), the shared rule factories
(replacements.py) and the mechanisms beside them (PEFT LoRA, MoE, packed attention, offload). It knows no model
type: foak.models holds each architecture's rules and foak.api applies them (``foak.patch``)."""

from __future__ import annotations

from foak.patching.rules import PatchReport, Rule, RuleResult, Trigger, apply, is_patched, restore

__all__ = ["PatchReport", "Rule", "RuleResult", "Trigger", "apply", "is_patched", "restore"]
