"""Qwen3.5's text model as ``AutoModelForCausalLM`` loads it (also from a multimodal ``qwen3_5`` checkpoint):
``Qwen3_5ForCausalLM`` over ``Qwen3_5TextConfig``. The rules are the family's (foak.models.qwen3_5)."""

from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

from foak.models.qwen3_5 import hybrid_rules


def rules():
    return hybrid_rules("qwen3_5_text", modeling, "Qwen3_5", "Qwen3_5ForCausalLM", "Qwen3_5MLP")
