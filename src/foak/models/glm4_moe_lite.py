"""GLM-4-MoE-Lite (GLM-4.7-Flash; DeepSeek-V3's MLA attention with GLM-4-MoE's experts): RMSNorm (incl. MLA's
q_a_layernorm / kv_a_layernorm), RoPE on the rotary part of q and k (``rope_interleave``: through foak's rope
op after one de-interleaving gather, exactly transformers' ``apply_rotary_pos_emb_interleave``), the SwiGLU
MLPs (the "dense" ``mlp_layer_types`` layers' and each sparse layer's shared experts), loss, and the routed
experts (Glm4MoeLiteExperts) as foak's MoE implementation (``fast_moe``: transformers' experts interface,
foak.patching.moe). The router (grouped sigmoid top-k with ``e_score_correction_bias``) stays transformers'."""

from transformers.models.glm4_moe_lite import modeling_glm4_moe_lite as modeling

from foak.patching.moe import moe_experts_rule
from foak.patching.replacements import decoder_rules, interleaved_rope_rule


def rules():
    rope = interleaved_rope_rule("glm4_moe_lite", modeling.Glm4MoeLiteAttention)
    return [*(rope if r.switch == "rope" else r for r in decoder_rules("glm4_moe_lite", modeling, "Glm4MoeLite")),
            moe_experts_rule("glm4_moe_lite", modeling, "Glm4MoeLiteExperts")]
