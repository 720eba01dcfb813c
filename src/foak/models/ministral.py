"""Ministral: Llama-like (RMSNorm, RoPE, SwiGLU MLP, loss); its sliding-window layers (config.layer_types) pass
their window to the attention function, which packed attention honours."""

from transformers.models.ministral import modeling_ministral as modeling

from foak.patching.replacements import decoder_rules


def rules():
    return decoder_rules("ministral", modeling, "Ministral")
