"""OLMo 3: as OLMo 2 (RMSNorm in "olmo" mode, also q_norm / k_norm over the whole projection; RoPE with q and k
in their own dtype; SwiGLU MLP, loss); its sliding-window layers (config.layer_types) pass their window to the
attention function, which packed attention honours."""

from transformers.models.olmo3 import modeling_olmo3 as modeling

from foak.patching.replacements import decoder_rules


def rules():
    return decoder_rules("olmo3", modeling, "Olmo3", norm_mode="olmo", rope_input_dtype=True)
