"""Granite: RMSNorm, RoPE, SwiGLU MLP, loss. The fused head divides its logits by logits_scaling
(HF divides the logits before the loss); the residual/embedding multipliers stay in the HF forward."""

from transformers.models.granite import modeling_granite as modeling

from foak.patching.replacements import decoder_rules


def rules():
    return decoder_rules("granite", modeling, "Granite", logits_divisor="logits_scaling")
