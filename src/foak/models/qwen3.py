"""Qwen3: RMSNorm (also the per-head q_norm/k_norm), RoPE, SwiGLU MLP, loss."""

from transformers.models.qwen3 import modeling_qwen3 as modeling

from foak.patching.replacements import decoder_rules


def rules():
    return decoder_rules("qwen3", modeling, "Qwen3")
