"""Qwen3.5-MoE: the Qwen3.5 hybrid (foak.models.qwen3_5) whose every layer's MLP is a sparse MoE block. foak's:
the experts (Qwen3_5MoeExperts) as foak's MoE implementation (``fast_moe``, foak.patching.moe) and the shared
expert's SwiGLU MLP (Qwen3_5MoeMLP); transformers': the router, the shared expert's sigmoid gate and the
auxiliary loss. Serves ``qwen3_5_moe`` (``Qwen3_5MoeForConditionalGeneration``, multimodal);
``AutoModelForCausalLM`` loads ``qwen3_5_moe_text`` (foak.models.qwen3_5_moe_text)."""

from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as modeling

from foak.models.qwen3_5 import hybrid_rules
from foak.patching.moe import moe_experts_rule


def moe_rules(arch: str, causal_lm: str) -> list:
    return [*hybrid_rules(arch, modeling, "Qwen3_5Moe", causal_lm, "Qwen3_5MoeMLP"),
            moe_experts_rule(arch, modeling, "Qwen3_5MoeExperts")]


def rules():
    return moe_rules("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration")
