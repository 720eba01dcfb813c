"""Gemma 2: as Gemma (foak.models.gemma), plus the final-logit softcap served inside the fused loss
(``tanh(logits / cap) * cap``, foak.ops.linear_cross_entropy's ``softcap``). Its attention-logit softcap
(``attn_logit_softcapping``) keeps transformers' attention: the packed_attention row says so (with the
softcap set, a packed batch keeps transformers' block-causal mask); sliding-window layers pass their window
on to foak's packed attention."""

from transformers.models.gemma2 import modeling_gemma2 as modeling

from foak.models.gemma import gemma_rules


def rules():
    return gemma_rules("gemma2", modeling, "Gemma2", final_softcap=True)
