"""Patching: the generic mechanism (rules.py), the shared rule factories (replacements.py) and the
public entry points ``patch`` / ``restore``."""

from __future__ import annotations

import torch

from foak.patching.rules import PatchReport, Rule, RuleResult, Trigger, apply, is_patched, restore

# config switches with no implementation yet: enabling one is an error, never a silent no-op
NOT_IMPLEMENTED: dict[str, str] = {}


def patch(model, config=None, *, mixed_precision: str | None = None, **switches) -> PatchReport:
    """Patch a loaded HF causal LM with foak's kernels, as ``config`` (a path to the acceleration YAML, its
    parsed dict, an AccelerationConfig) or keyword switches (``fast_rms_layernorm=True, ...``) ask.

    ``mixed_precision`` ("no", "fp16", "bf16"; what the trainer will use) is checked against the model's
    weight dtype with the compatibility matrix of foak.config.check_precision.
    Returns the PatchReport (print it for the table). Applying twice is a no-op; ``restore`` undoes it.
    """
    from foak.config import check_precision, config_from_kwargs, load_config
    from foak.models import model_type_of, rules_for

    if config is not None and switches:
        raise ValueError("foak.patch: pass either a config or keyword switches, not both")
    from foak.patching.peft import is_peft_model

    if config is None and "mode" not in switches:
        # keyword switches on a PEFT model are the peft stanza's (fused_lora is only valid there)
        if is_peft_model(model):
            switches["mode"] = "peft"
        elif switches.get("fused_lora"):
            raise ValueError("foak.patch: fused_lora=True needs a PEFT LoRA model (wrap the model with "
                             "peft.get_peft_model first), or drop fused_lora for full fine-tuning")
    cfg = load_config(config) if config is not None else config_from_kwargs(**switches)
    enabled = cfg.enabled_rules()
    if mixed_precision is not None:
        weights = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        check_precision(weights, mixed_precision, peft=cfg.mode == "peft")
    missing = [NOT_IMPLEMENTED[s] for s in sorted(enabled & NOT_IMPLEMENTED.keys())]
    if cfg.base_layer != "none":
        # the base is detected from the model; the setting only asserts what the user expects it to hold
        from foak.patching.lora_bases import BNB_NF4, GPTQ, format_of

        fmt, how = {"bitsandbytes": (BNB_NF4, "a bitsandbytes Linear4bit (load it with BitsAndBytesConfig("
                                              "load_in_4bit=True, ...)"),
                    "gptq": (GPTQ, "a foak GPTQLinear (load it with foak.quant.load_gptq, and register "
                                   "foak.quant.gptq_peft.register_gptq_lora on the LoraConfig")}[cfg.base_layer]
        if not any(format_of(m) is fmt for m in model.modules()):
            raise ValueError(f"foak.patch: base_layer: {cfg.base_layer}, but the model holds no PEFT LoRA layer over "
                             f"{how} and wrap it with peft.get_peft_model); or remove base_layer: foak detects the "
                             "base itself")
    if missing:
        raise ValueError("foak.patch: " + "; ".join(missing) + ". Remove these switches from the config.")
    if not enabled:
        raise ValueError("foak.patch: the config enables no kernel; nothing to patch")
    model_type = model_type_of(model)
    rules = rules_for(model)
    report = apply(model, [r for r in rules if r.switch in enabled], model_type)
    available = {r.switch for r in rules}
    for switch in sorted(enabled - available):
        if not any(r.switch == switch for r in report.results):
            report.results.append(RuleResult(f"{model_type}.{switch}", switch, 0, "-",
                                             f"no rule for {model_type} (see foak/models/{model_type}.py)"))
    return report


__all__ = ["PatchReport", "Rule", "RuleResult", "Trigger", "apply", "is_patched", "patch", "restore"]
