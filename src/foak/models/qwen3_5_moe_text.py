"""Qwen3.5-MoE's text model as ``AutoModelForCausalLM`` loads it: ``Qwen3_5MoeForCausalLM`` over
``Qwen3_5MoeTextConfig`` (foak.models.qwen3_5_moe)."""

from foak.models.qwen3_5_moe import moe_rules


def rules():
    return moe_rules("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")
