"""Mixtral: RMSNorm, RoPE, loss, and the experts (MixtralExperts) as foak's MoE implementation
(``fast_moe``: transformers' experts interface, foak.patching.moe) and the router's softmax/top-k as one
kernel each way (foak.patching.moe_router). The auxiliary loss stays in the HF forward, which the loss rules
wrap rather than replace."""

from transformers.models.mixtral import modeling_mixtral as modeling

from foak.patching.moe import moe_experts_rule
from foak.patching.moe_router import moe_router_rule
from foak.patching.replacements import decoder_rules


def rules():
    return [*decoder_rules("mixtral", modeling, "Mixtral", gated_mlp=False),
            moe_experts_rule("mixtral", modeling, "MixtralExperts"),
            moe_router_rule("mixtral", modeling, "MixtralTopKRouter")]
