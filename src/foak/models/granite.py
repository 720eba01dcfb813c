"""Granite: RMSNorm, RoPE, SwiGLU MLP, loss. logits_scaling divides the hidden states before the
fused head (it commutes with the matmul); the residual/embedding multipliers stay in the HF forward."""

from transformers.models.granite import modeling_granite as modeling

from foak.patching.replacements import decoder_rules


def rules():
    return decoder_rules("granite", modeling, "Granite")
