"""Gemma 4 (text only, Gemma4ForCausalLM): foak.models.gemma.gemma4_rules. The per-layer inputs (their
embedding, projection and gate), the layer scalars and the scaled embeddings stay in the HF forward."""

from transformers.models.gemma4 import modeling_gemma4 as modeling

from foak.models.gemma import gemma4_rules


def rules():
    return gemma4_rules("gemma4_text", modeling, modeling.Gemma4ForCausalLM)
