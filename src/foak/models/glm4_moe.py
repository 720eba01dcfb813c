"""GLM-4-MoE (GLM-4.5 / 4.6): RMSNorm (with the optional q_norm/k_norm), RoPE (partial rotary:
``partial_rotary_factor`` of each head rotated, the rest passed through), the SwiGLU MLPs (the first
``first_k_dense_replace`` dense layers' and each sparse layer's shared experts), loss, and the routed experts
(Glm4MoeExperts) as foak's MoE implementation (``fast_moe``: transformers' experts interface,
foak.patching.moe). The router (sigmoid scores, ``e_score_correction_bias``, group-limited top-k,
``routed_scaling_factor``) stays transformers'."""

from transformers.models.glm4_moe import modeling_glm4_moe as modeling

from foak.patching.moe import moe_experts_rule
from foak.patching.replacements import decoder_rules


def rules():
    return [*decoder_rules("glm4_moe", modeling, "Glm4Moe"),
            moe_experts_rule("glm4_moe", modeling, "Glm4MoeExperts")]
