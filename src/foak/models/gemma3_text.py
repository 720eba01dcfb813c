"""Gemma 3 (text only, Gemma3ForCausalLM): as Gemma (foak.models.gemma), with the (1 + w) q_norm/k_norm
per head, the final-logit softcap (when the config sets one) inside the fused loss, and the local
(sliding-window) / global layers of ``layer_types`` passing their window on to foak's packed attention."""

from transformers.models.gemma3 import modeling_gemma3 as modeling

from foak.models.gemma import gemma_rules


def rules():
    return gemma_rules("gemma3_text", modeling, "Gemma3", text_model=modeling.Gemma3TextModel, final_softcap=True)
