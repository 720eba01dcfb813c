"""foak's public entry points: ``patch`` (the rules of the model's architecture from foak.models, applied by the
mechanism of foak.patching), ``default_config`` and ``restore``. This module sits above models/, patching/ and
integrations/: importing it registers foak's servers for TRL's fused LM head and distillation loss
(foak.integrations.trl, trl_distill) with the fused_linear_loss rule, so every way of patching has them, while
``import foak`` alone stays light."""

from __future__ import annotations

import functools

import torch

import foak.integrations.trl  # noqa: F401  (registers the fused-head server)
import foak.integrations.trl_distill  # noqa: F401  (registers the distillation-loss server)
from foak.patching.new_layers import NewLoraLayers
from foak.patching.rules import _STATE_ATTR, PatchReport, RuleResult, apply, is_patched, restore

# config switches with no implementation yet: enabling one is an error, never a silent no-op
NOT_IMPLEMENTED: dict[str, str] = {}


def default_config(model, **overrides):
    """The AccelerationConfig of every switch foak has for ``model``'s architecture: ``fast_rms_layernorm``,
    ``fast_rope_embeddings``, ``fast_swiglu``, ``fast_moe``, ``fast_packed_attention`` (acts on packed batches
    only) where the architecture has rules for them,
    ``fused_linear_loss`` (``fast_loss`` instead where the fused head cannot apply, e.g. a final logit
    softcap), and ``fused_lora`` on a PEFT model (the ``peft`` stanza then; the ``training`` one otherwise).
    Not included: ``fast_loss`` next to ``fused_linear_loss`` (they exclude each other) and switches in
    NOT_IMPLEMENTED. Each rule computes exactly what the module it replaces would in every weight dtype and
    mixed precision foak takes, and takes the original path (counted in the report) where it cannot;
    ``patch(..., mixed_precision=...)`` checks the dtype combination itself. A ValueError for an architecture
    foak has no rules for. Keyword ``overrides`` (``tiled_mlp=True``, ``fast_rope_embeddings=False``, ...) replace
    the defaults of those switches, validated as any config (the stanza stays the default's)."""
    from foak.config import SWITCH_TO_RULE, config_from_kwargs
    from foak.models import rules_for
    from foak.patching.peft import is_peft_model

    rules = rules_for(model)
    available = {r.switch for r in rules} - NOT_IMPLEMENTED.keys()
    available.discard("tiled_mlp")  # opt-in: it trades one more MLP forward per step for long-context memory
    peft = is_peft_model(model)
    if not peft:
        available.discard("lora")
    if "fused_linear_loss" in available:
        fused = next(r for r in rules if r.switch == "fused_linear_loss")
        if fused.skip_reason is None or fused.skip_reason(model) is None:
            available.discard("loss")
        elif "loss" in available:
            available.discard("fused_linear_loss")
    switches = {key: True for key, rule in SWITCH_TO_RULE.items() if rule in available}
    config = config_from_kwargs("peft" if peft else "full", **switches)
    if not overrides:
        return config
    return config_from_kwargs(config.mode, **{**config.model_dump(exclude={"mode"}), **overrides})


def rules_of(model, offload: bool = False, offload_budget_gib: float | None = None) -> list:
    """Every rule foak has for ``model``'s architecture (foak.models.rules_for), and the offload_activations rule
    when ``offload`` (its budget with it): the rules source of foak.patching.apply (the rows, LoRA layers added
    later, a pickled patched model loading again)."""
    from foak.models import rules_for

    rules = rules_for(model)
    if offload:
        from foak.models import model_type_of
        from foak.patching.offload import offload_activations_rule

        rules = [*rules, offload_activations_rule(model_type_of(model), offload_budget_gib)]
    return rules


def patch(model, config=None, *, mixed_precision: str | None = None, **switches) -> PatchReport:
    """Patch a loaded HF causal LM with foak's kernels, as ``config`` (a path to the acceleration YAML, its
    parsed dict, an AccelerationConfig) or keyword switches (``fast_rms_layernorm=True, ...``) ask. With
    neither, every switch foak has for the model (:func:`default_config`: the kernels of its architecture,
    ``fused_lora`` on a PEFT model).

    ``mixed_precision`` ("no", "fp16", "bf16"; what the trainer will use) is checked against the model's
    weight dtype with the compatibility matrix of foak.config.check_precision.
    Returns the PatchReport (print it for the table). Applying twice is a no-op; ``restore`` undoes it.
    """
    from foak.config import check_precision, config_from_kwargs, load_config
    from foak.models import model_type_of

    if config is not None and switches:
        raise ValueError("foak.patch: pass either a config or keyword switches, not both")
    from foak.patching.peft import is_peft_model

    use_default = config is None and not switches
    if config is None and "mode" not in switches and not use_default:
        # keyword switches on a PEFT model are the peft stanza's (fused_lora is only valid there)
        # (fused_lora on a model without LoRA layers yet: the layers PEFT adds later are fused when they appear)
        if is_peft_model(model) or switches.get("fused_lora"):
            switches["mode"] = "peft"
    if use_default:
        cfg = default_config(model)
    else:
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
    # not per architecture: offload acts on every decoder stack of HF checkpointing layers
    source = functools.partial(rules_of, offload="offload_activations" in enabled,
                               offload_budget_gib=cfg.offload_budget_gib)
    rules = source(model)
    from foak.patching.packed_attention import CUDNN_ATTR
    from foak.patching.replacements import TILED_MLP_CHUNK_ATTR

    # (set or cleared by every patch of an unpatched model: foak.restore keeps them, a deepcopy re-patches with them;
    # a model patched with cudnn_attention, restored and patched without it kept asking for cuDNN. Patching a patched
    # model again changes nothing: apply returns its report)
    settings = () if _STATE_ATTR in model.__dict__ else (
        (CUDNN_ATTR, cfg.cudnn_attention or None),
        (TILED_MLP_CHUNK_ATTR, cfg.tiled_mlp_chunk_tokens if cfg.tiled_mlp else None))
    for attr, value in settings:
        if value is None:
            model.__dict__.pop(attr, None)
        else:
            object.__setattr__(model, attr, value)
    # LoRA layers added after this call (get_peft_model, SFTTrainer(peft_config=...), add_adapter) are fused on
    # the model's next forward with foak's defaults or a config that enables fused_lora (foak.patching.new_layers)
    fuse_new = use_default or "lora" in enabled
    report = apply(model, [r for r in rules if r.switch in enabled or (fuse_new and r.switch == "lora")],
                   model_type, watch=NewLoraLayers(enabled, fuse_new), rules_source=source)
    _note_bitsandbytes_cpu(model, report)
    available = {r.switch for r in rules}
    for switch in sorted(enabled - available):
        if not any(r.switch == switch for r in report.results):
            report.results.append(RuleResult(f"{model_type}.{switch}", switch, 0, "-",
                                             f"no rule for {model_type} (see foak/models/{model_type}.py)"))
    return report


def _note_bitsandbytes_cpu(model, report: PatchReport) -> None:
    """NF4 layers on the CPU that bitsandbytes' own dequantization gets wrong here (foak.patching.bnb_cpu, which
    also warns): said in the fused_lora row, or a row of its own when fused_lora is off."""
    from foak.patching.bnb_cpu import check_model

    note = check_model(model, stacklevel=4)  # (the warning points at foak.patch's caller)
    if note is None or any(note in r.notes for r in report.results):  # (patching twice returns the same report)
        return
    row = next((r for r in report.results if r.rule_id.endswith(".fused_lora")), None)
    if row is None:
        report.results.append(RuleResult(f"{report.model_type}.bitsandbytes_cpu", "-", 0, "-", note))
    else:
        row.note_runtime("bitsandbytes_cpu", note)  # (kept when the rules are applied again)


__all__ = ["PatchReport", "default_config", "is_patched", "patch", "restore"]
