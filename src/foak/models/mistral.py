"""Mistral: RMSNorm, RoPE, SwiGLU MLP, loss (sliding-window attention is untouched)."""

from transformers.models.mistral import modeling_mistral as modeling

from foak.patching.replacements import decoder_rules


def rules():
    return decoder_rules("mistral", modeling, "Mistral")
