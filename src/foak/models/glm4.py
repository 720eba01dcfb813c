"""GLM-4: RMSNorm (also the post_self_attn / post_mlp norms), RoPE in GLM's interleaved layout (adjacent pairs,
partial rotary: foak.ops.rope's ``interleaved``), the gated MLP with one fused gate_up_proj, loss."""

from transformers.models.glm4 import modeling_glm4 as modeling

from foak.patching.replacements import decoder_rules, fused_glu_mlp_rule


def rules():
    rules = decoder_rules("glm4", modeling, "Glm4", gated_mlp=False, rope_interleaved=True)
    rope = next(i for i, r in enumerate(rules) if r.switch == "rope")
    rules.insert(rope + 1, fused_glu_mlp_rule("glm4", modeling.Glm4MLP))
    return rules
