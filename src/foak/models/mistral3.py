"""Mistral 3 multimodal (Mistral3ForConditionalGeneration): its text tower is the model of its
text_config's type: a Mistral model (MistralModel) or a Ministral 3 model (Ministral3Model, with the q scaling
of foak.models.ministral3); either way RMSNorm, RoPE, SwiGLU MLP, packed attention with its sliding window,
and the fused loss on its head. The rules follow the model's text_config (another text type gets the Mistral
rows, which then say they matched nothing). The Pixtral vision tower and the projector (its Mistral3RMSNorm
included) keep their HF forwards; they run only on images (PEFT LoRA layers on them are fused by the
fused_lora rows)."""

from transformers.models.ministral3 import modeling_ministral3
from transformers.models.mistral import modeling_mistral
from transformers.models.mistral3 import modeling_mistral3 as modeling

from foak.patching.packed_attention import packed_attention_rule
from foak.patching.replacements import (causal_lm_rules, glu_mlp_rule, rms_norm_recompute_rule, rms_norm_rule,
                                        rope_rule)

TEXT_TOWERS = {"mistral": (modeling_mistral, "Mistral"), "ministral3": (modeling_ministral3, "Ministral3")}


def rules(model=None):
    arch = "mistral3"
    text_config = getattr(getattr(model, "config", None), "text_config", None)
    text, prefix = TEXT_TOWERS.get(getattr(text_config, "model_type", None), TEXT_TOWERS["mistral"])
    stack = getattr(text, f"{prefix}Model")
    return [rms_norm_rule(arch, getattr(text, f"{prefix}RMSNorm")),
            rms_norm_recompute_rule(arch, stack),
            rope_rule(arch, getattr(text, f"{prefix}Attention")),
            glu_mlp_rule(arch, getattr(text, f"{prefix}MLP")),
            *causal_lm_rules(arch, modeling.Mistral3ForConditionalGeneration),
            packed_attention_rule(arch, stack)]
