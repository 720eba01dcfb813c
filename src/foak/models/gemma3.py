"""Gemma 3 multimodal (Gemma3ForConditionalGeneration): the rules of foak.models.gemma3_text for its text
tower (Gemma3TextModel), and the fused loss on the ForConditionalGeneration head (which applies no
final-logit softcap). Packed attention takes over where Gemma3Model builds the text tower's masks (a batch
with image tokens, whose blocks attend both ways, keeps transformers' mask). The SigLIP vision tower keeps
its HF forwards; the projector's (1 + w) norm is foak's (PEFT LoRA layers are fused by the fused_lora rows)."""

from transformers.models.gemma3 import modeling_gemma3 as modeling

from foak.models.gemma import gemma_rules


def rules():
    return gemma_rules("gemma3", modeling, "Gemma3", causal_lm=modeling.Gemma3ForConditionalGeneration,
                       text_model=modeling.Gemma3TextModel, multimodal_model=modeling.Gemma3Model,
                       image_blocks="token_type_ids")
