"""Mistral 3 multimodal (Mistral3ForConditionalGeneration): its text tower is a Mistral model (MistralModel:
RMSNorm, RoPE, SwiGLU MLP, packed attention with its sliding window) and its head gets the fused loss. The
Pixtral vision tower and the projector (its Mistral3RMSNorm included) keep their HF forwards; they run only
on images (PEFT LoRA layers on them are fused by the fused_lora rows). A checkpoint whose text_config is
another model type (e.g. ministral3) builds other text classes: these rows then say they matched nothing."""

from transformers.models.mistral import modeling_mistral as text
from transformers.models.mistral3 import modeling_mistral3 as modeling

from foak.patching.packed_attention import packed_attention_rule
from foak.patching.replacements import (causal_lm_rules, glu_mlp_rule, rms_norm_recompute_rule, rms_norm_rule,
                                        rope_rule)


def rules():
    arch = "mistral3"
    return [rms_norm_rule(arch, text.MistralRMSNorm),
            rms_norm_recompute_rule(arch, text.MistralModel),
            rope_rule(arch, text.MistralAttention),
            glu_mlp_rule(arch, text.MistralMLP),
            *causal_lm_rules(arch, modeling.Mistral3ForConditionalGeneration),
            packed_attention_rule(arch, text.MistralModel)]
