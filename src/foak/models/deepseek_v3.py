"""DeepSeek-V3: RMSNorm (the layers' norms and MLA's q_a_layernorm / kv_a_layernorm), RoPE on the rotary part of
q and k (``q_rot`` / ``k_rot``; with ``rope_interleave`` through foak's rope op after one de-interleaving gather,
which computes exactly transformers' ``apply_rotary_pos_emb_interleave``), the SwiGLU MLPs (the first
``first_k_dense_replace`` dense layers' and each sparse layer's shared experts), loss, and the routed experts
(DeepseekV3Experts) as foak's MoE implementation (``fast_moe``: transformers' experts interface,
foak.patching.moe). The router (sigmoid scores, ``e_score_correction_bias``, group-limited top-k,
``routed_scaling_factor``) and MLA's projections and attention stay transformers'."""

from transformers.models.deepseek_v3 import modeling_deepseek_v3 as modeling

from foak.patching.moe import moe_experts_rule
from foak.patching.replacements import decoder_rules, interleaved_rope_rule


def rules():
    rope = interleaved_rope_rule("deepseek_v3", modeling.DeepseekV3Attention)
    return [*(rope if r.switch == "rope" else r for r in decoder_rules("deepseek_v3", modeling, "DeepseekV3")),
            moe_experts_rule("deepseek_v3", modeling, "DeepseekV3Experts")]
