"""Qwen2: RMSNorm, RoPE, SwiGLU MLP, loss."""

from transformers.models.qwen2 import modeling_qwen2 as modeling

from foak.patching.replacements import decoder_rules


def rules():
    return decoder_rules("qwen2", modeling, "Qwen2")
