"""Qwen3-MoE: RMSNorm (with q_norm/k_norm), RoPE, the dense SwiGLU MLPs of non-sparse layers, loss, and
the experts of the sparse layers (Qwen3MoeExperts) as foak's MoE implementation (``fast_moe``:
transformers' experts interface, foak.patching.moe) with the router's softmax/top-k as one kernel each
way (foak.patching.moe_router). The auxiliary loss stays in the HF forward."""

from transformers.models.qwen3_moe import modeling_qwen3_moe as modeling

from foak.patching.moe import moe_experts_rule
from foak.patching.moe_router import moe_router_rule
from foak.patching.replacements import decoder_rules


def rules():
    return [*decoder_rules("qwen3_moe", modeling, "Qwen3Moe"),
            moe_experts_rule("qwen3_moe", modeling, "Qwen3MoeExperts"),
            moe_router_rule("qwen3_moe", modeling, "Qwen3MoeTopKRouter")]
