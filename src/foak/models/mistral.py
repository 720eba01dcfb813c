"""Mistral: RMSNorm, RoPE, SwiGLU MLP, loss, packed and sliding-window attention (foak.patching.packed_attention)."""

from transformers.models.mistral import modeling_mistral as modeling

from foak.patching.replacements import decoder_rules


def rules():
    return decoder_rules("mistral", modeling, "Mistral")
