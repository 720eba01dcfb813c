"""Ministral 3 (Ministral3ForCausalLM): Llama-like (RMSNorm, RoPE, SwiGLU MLP, loss), with an optional sliding
window (config.sliding_window, one for every layer) that packed attention honours. Its attention scales q by
position after the rotation (Llama 4's ``llama_4_scaling_beta``): foak's rope replaces only the modeling
module's ``apply_rotary_pos_emb``; that scaling stays in transformers' attention forward, on the position ids
the layer is given (restarting per packed sequence, as unpatched)."""

from transformers.models.ministral3 import modeling_ministral3 as modeling

from foak.patching.replacements import decoder_rules


def rules():
    return decoder_rules("ministral3", modeling, "Ministral3")
