"""Mixtral: RMSNorm, RoPE, loss, and the experts (MixtralExperts) as foak's MoE implementation
(``fast_moe``: transformers' experts interface, foak.patching.moe). The router and its auxiliary loss
stay in the HF forward, which the loss rules wrap rather than replace."""

from transformers.models.mixtral import modeling_mixtral as modeling

from foak.patching.moe import moe_experts_rule
from foak.patching.replacements import decoder_rules


def rules():
    return [*decoder_rules("mixtral", modeling, "Mixtral", gated_mlp=False),
            moe_experts_rule("mixtral", modeling, "MixtralExperts")]
