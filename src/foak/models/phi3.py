"""Phi-3: RMSNorm, RoPE (partial rotary through foak's rope op), the gated MLP with one fused gate_up_proj,
loss. q, k, v come from one fused qkv_proj (with PEFT, one LoRA layer that fused_lora fuses as one call)."""

from transformers.models.phi3 import modeling_phi3 as modeling

from foak.patching.replacements import decoder_rules, fused_glu_mlp_rule


def rules():
    rules = decoder_rules("phi3", modeling, "Phi3", gated_mlp=False)
    rope = next(i for i, r in enumerate(rules) if r.switch == "rope")
    rules.insert(rope + 1, fused_glu_mlp_rule("phi3", modeling.Phi3MLP))
    return rules
