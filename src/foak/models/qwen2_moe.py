"""Qwen2-MoE: RMSNorm, RoPE, the SwiGLU MLPs (the dense layers' and each sparse layer's shared expert, whose
sigmoid ``shared_expert_gate`` stays in the HF block forward), loss, and the routed experts (Qwen2MoeExperts)
as foak's MoE implementation (``fast_moe``: transformers' experts interface, foak.patching.moe). The router
(softmax, top-k, optional renormalisation) and the auxiliary loss stay transformers'."""

from transformers.models.qwen2_moe import modeling_qwen2_moe as modeling

from foak.patching.moe import moe_experts_rule
from foak.patching.replacements import decoder_rules


def rules():
    return [*decoder_rules("qwen2_moe", modeling, "Qwen2Moe"),
            moe_experts_rule("qwen2_moe", modeling, "Qwen2MoeExperts")]
