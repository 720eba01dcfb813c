"""SmolLM3: Llama-like (RMSNorm, RoPE, SwiGLU MLP, loss). Its NoPE layers (``config.no_rope_layers[i] == 0``)
apply no rotary embedding: the RoPE rule leaves their attention alone and its row counts them."""

from transformers.models.smollm3 import modeling_smollm3 as modeling

from foak.patching.replacements import decoder_rules


def _nope_layer(attention):
    if not attention.use_rope:
        return "a NoPE layer (config.no_rope_layers): it applies no rotary embedding"
    return None


def rules():
    return decoder_rules("smollm3", modeling, "SmolLM3", rope_skip=_nope_layer)
