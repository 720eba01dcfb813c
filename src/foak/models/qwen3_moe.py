"""Qwen3-MoE: RMSNorm (with q_norm/k_norm), RoPE, the dense SwiGLU MLPs of non-sparse layers, loss.
The experts wait for foak's MoE kernels; the auxiliary loss stays in the HF forward."""

from transformers.models.qwen3_moe import modeling_qwen3_moe as modeling

from foak.patching.replacements import decoder_rules


def rules():
    return decoder_rules("qwen3_moe", modeling, "Qwen3Moe")
