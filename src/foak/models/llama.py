"""Llama: RMSNorm, RoPE, SwiGLU MLP, loss."""

from transformers.models.llama import modeling_llama as modeling

from foak.patching.replacements import decoder_rules


def rules():
    return decoder_rules("llama", modeling, "Llama")
