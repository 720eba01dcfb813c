"""Qwen3-MoE: RMSNorm (with q_norm/k_norm), RoPE, the dense SwiGLU MLPs of non-sparse layers, loss, and
the experts of the sparse layers (Qwen3MoeExperts) as foak's MoE implementation (``fast_moe``:
transformers' experts interface, foak.patching.moe). The router and the auxiliary loss stay in the HF
forward."""

from transformers.models.qwen3_moe import modeling_qwen3_moe as modeling

from foak.patching.moe import moe_experts_rule
from foak.patching.replacements import decoder_rules


def rules():
    return [*decoder_rules("qwen3_moe", modeling, "Qwen3Moe"),
            moe_experts_rule("qwen3_moe", modeling, "Qwen3MoeExperts")]
