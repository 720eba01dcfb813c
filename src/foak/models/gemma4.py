"""Gemma 4 multimodal (Gemma4ForConditionalGeneration): foak.models.gemma.gemma4_rules for its text tower,
the fused loss (with the text config's final-logit softcap) on its head, packed attention where Gemma4Model
builds the text tower's masks. The vision (and audio) towers' Gemma4RMSNorms are the same class and formula
and run foak's norm; their attention and MLPs keep their HF forwards."""

from transformers.models.gemma4 import modeling_gemma4 as modeling

from foak.models.gemma import gemma4_rules


def rules():
    return gemma4_rules("gemma4", modeling, modeling.Gemma4ForConditionalGeneration,
                        multimodal_model=modeling.Gemma4Model)
