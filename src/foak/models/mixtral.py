"""Mixtral: RMSNorm, RoPE, loss. The experts (MixtralExperts) wait for foak's MoE kernels; the
router's auxiliary loss stays in the HF forward, which the loss rules wrap rather than replace."""

from transformers.models.mixtral import modeling_mixtral as modeling

from foak.patching.replacements import decoder_rules


def rules():
    return decoder_rules("mixtral", modeling, "Mixtral", gated_mlp=False)
