"""GPTBigCode (StarCoder): loss only. It uses LayerNorm (foak has no LayerNorm kernel yet), learned
absolute positions (no RoPE) and a non-gated GELU MLP (no gated kernel applies)."""

from transformers.models.gpt_bigcode import modeling_gpt_bigcode as m

from foak.patching.replacements import causal_lm_rules


def rules():
    return causal_lm_rules("gpt_bigcode", m.GPTBigCodeForCausalLM)
