"""gpt-oss: RMSNorm (``(weight * x_hat).to(input dtype)``: foak's "olmo" mode), RoPE (its cos/sin hold one value
per frequency; the rotation is the rotate_half one, so foak's rope op runs on them repeated), the loss, and
the experts (GptOssExperts: transposed weights with biases, interleaved gate/up columns, the clamped SwiGLU
``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``) as foak's MoE
implementation (``fast_moe``). The router (a biased linear, top-k, softmax over the top values) and its
auxiliary loss stay in the HF forward. The attention with its per-head sink logits (``GptOssAttention.sinks``,
passed as ``s_aux``) runs foak's varlen attention with ``sinks`` (fast_packed_attention): packed batches, and
every layer of unpacked/padded ones (transformers' gpt-oss attention is eager: [B, H, S, S] scores)."""

from transformers.models.gpt_oss import modeling_gpt_oss as modeling

from foak.patching.moe import CustomGate, moe_experts_rule
from foak.patching.packed_attention import packed_attention_rule
from foak.patching.replacements import causal_lm_rules, rms_norm_recompute_rule, rms_norm_rule, rope_rule

# GptOssExperts._apply_gate: gate/up interleaved in gate_up_proj's columns, [E, H, 2I] / [E, I, H] weights,
# biases on both projections; alpha and limit read from the module at every call
GPT_OSS_GATE = CustomGate("clamped_swiglu", is_concatenated=False, is_transposed=True, has_bias=True,
                          params=("alpha", "limit"))


def rules():
    arch = "gpt_oss"
    return [rms_norm_rule(arch, modeling.GptOssRMSNorm, mode="olmo"),
            rms_norm_recompute_rule(arch, modeling.GptOssModel),
            rope_rule(arch, modeling.GptOssAttention, half_cos_sin=True),
            *causal_lm_rules(arch, modeling.GptOssForCausalLM),
            packed_attention_rule(arch, modeling.GptOssModel),
            moe_experts_rule(arch, modeling, "GptOssExperts", gate=GPT_OSS_GATE)]
