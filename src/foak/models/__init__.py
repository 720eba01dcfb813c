"""One small declarative file per architecture: which foak rules apply to which module classes.

``rules_for(model)`` looks the model's ``config.model_type`` up here. Adding an architecture = one file
with a ``rules()`` function and one line in ``ARCHITECTURES``.
"""

from __future__ import annotations

import importlib
import inspect

# model_type -> module holding its rules
ARCHITECTURES = {
    "llama": "foak.models.llama",
    "mistral": "foak.models.mistral",
    "mixtral": "foak.models.mixtral",
    "granite": "foak.models.granite",
    "granitemoe": "foak.models.granitemoe",
    "gpt_bigcode": "foak.models.gpt_bigcode",
    "qwen2": "foak.models.qwen2",
    "qwen3": "foak.models.qwen3",
    "qwen3_moe": "foak.models.qwen3_moe",
    # ---- dense decoders (phi3, glm4, olmo2, olmo3, smollm3, ministral) ----
    "phi3": "foak.models.phi3",
    "glm4": "foak.models.glm4",
    "olmo2": "foak.models.olmo2",
    "olmo3": "foak.models.olmo3",
    "smollm3": "foak.models.smollm3",
    "ministral": "foak.models.ministral",
    # ---- ministral3 ----
    "ministral3": "foak.models.ministral3",

    # ---- Gemma family and multimodal text towers (gemma*, mistral3) ----
    "gemma": "foak.models.gemma",
    "gemma2": "foak.models.gemma2",
    "gemma3": "foak.models.gemma3",
    "gemma3_text": "foak.models.gemma3_text",
    "gemma4": "foak.models.gemma4",
    "gemma4_text": "foak.models.gemma4_text",
    "mistral3": "foak.models.mistral3",

    # ---- MoE (qwen2_moe, glm4_moe, deepseek_v3, llama4, granitemoeshared) ----
    "qwen2_moe": "foak.models.qwen2_moe",
    "glm4_moe": "foak.models.glm4_moe",
    "glm4_moe_lite": "foak.models.glm4_moe_lite",
    "deepseek_v3": "foak.models.deepseek_v3",
    "granitemoeshared": "foak.models.granitemoeshared",
    # Llama4ForCausalLM (what AutoModelForCausalLM builds from a Llama-4 checkpoint) reports llama4_text
    "llama4_text": "foak.models.llama4_text",

    # ---- gpt-oss ----
    "gpt_oss": "foak.models.gpt_oss",

    # ---- Qwen3.5 hybrids ----
    "qwen3_5": "foak.models.qwen3_5",  # Qwen3_5ForConditionalGeneration (multimodal)
    "qwen3_5_text": "foak.models.qwen3_5_text",  # Qwen3_5ForCausalLM (AutoModelForCausalLM)
    "qwen3_5_moe": "foak.models.qwen3_5_moe",  # Qwen3_5MoeForConditionalGeneration (multimodal)
    "qwen3_5_moe_text": "foak.models.qwen3_5_moe_text",  # Qwen3_5MoeForCausalLM (AutoModelForCausalLM)

}


# checkpoints whose config.json names a model_type that AutoModelForCausalLM loads as another type foak serves
# (a Llama-4 checkpoint's "llama4" config: Llama4ForCausalLM over its text config, "llama4_text")
LOADED_AS = {"llama4": "llama4_text"}


def served_model_type(checkpoint_model_type: str | None) -> str | None:
    """The model_type foak patches when a checkpoint of ``checkpoint_model_type`` is loaded for causal LM
    training (itself, or what :data:`LOADED_AS` says it loads as)."""
    return LOADED_AS.get(checkpoint_model_type, checkpoint_model_type)


def model_type_of(model) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not model_type:
        raise ValueError(
            f"foak can only patch HuggingFace models with a config.model_type; got {type(model).__name__}"
        )
    return model_type


def rules_for(model):
    """The Rules of the model's architecture; a clear ValueError for an architecture foak does not know."""
    model_type = model_type_of(model)
    if model_type not in ARCHITECTURES:
        classes = sorted({type(m).__name__ for m in model.modules() if type(m).__module__.startswith("transformers")})
        raise ValueError(
            f"foak has no rules for model_type {model_type!r} ({type(model).__name__}); nothing was patched. "
            f"Supported architectures: {', '.join(sorted(ARCHITECTURES))}. Its modules ({', '.join(classes[:12])}"
            f"{', ...' if len(classes) > 12 else ''}) could be covered by adding foak/models/{model_type}.py "
            "with the rule factories of foak.patching.replacements."
        )
    from foak.patching.peft import lora_attention_rule, lora_linear_rule  # PEFT's LoRA layers

    rules_of_type = importlib.import_module(ARCHITECTURES[model_type]).rules
    # a multimodal type whose text tower follows its text_config (mistral3) picks its rules from the model
    rules = rules_of_type(model) if inspect.signature(rules_of_type).parameters else rules_of_type()
    # the LoRA q/k/v block wraps the attention forward inside the RoPE rule's wrapper (which casts the input
    # once under autocast): it comes before it in the list (a later rule wraps an earlier rule's forward)
    rope = next((i for i, r in enumerate(rules) if r.switch == "rope"), None)
    if rope is not None:
        rules.insert(rope, lora_attention_rule(model_type, rules[rope].trigger.module_class))
    from foak.patching.replacements import tiled_mlp_rule

    # the tiled MLP wraps whatever runs the gated MLP (swiglu rule, fused LoRA block): after them in the list
    mlp_triggers = [r.trigger for r in rules if r.switch == "swiglu"]
    experts = [r.trigger for r in rules if r.switch == "moe"]  # (not tiled: said in the tiled_mlp row)
    tiled = [tiled_mlp_rule(model_type, mlp_triggers, experts)] if mlp_triggers else []
    return [*rules, lora_linear_rule(model_type), *tiled]
