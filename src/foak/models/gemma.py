"""Gemma: (1 + w) RMSNorm (``mode="gemma"``), RoPE, GeGLU MLP (gelu_tanh), loss. The scaled embedding
(``hidden_size ** 0.5``) stays in the HF forward. Shared by the Gemma family files (gemma2, gemma3,
gemma3_text, gemma4, gemma4_text)."""

from transformers.models.gemma import modeling_gemma as modeling

from foak.patching.replacements import (causal_lm_rules, glu_mlp_rule, rms_norm_recompute_rule, rms_norm_rule,
                                        rope_rule)


def gemma_rules(arch: str, modeling, prefix: str, causal_lm: type | None = None, text_model: type | None = None,
                final_softcap: bool = False, multimodal_model: type | None = None, image_blocks: str | None = None):
    """The rules of a Gemma 1/2/3 decoder whose modeling module defines <prefix>RMSNorm (1 + w), <prefix>Attention,
    <prefix>MLP, and the stack ``text_model`` (default <prefix>Model) under the causal LM ``causal_lm`` (default
    <prefix>ForCausalLM; a multimodal ...ForConditionalGeneration whose text tower is ``text_model``).
    ``final_softcap``: the causal LM softcaps its logits before the loss (config.final_logit_softcapping),
    which the fused loss applies inside. ``multimodal_model``: the multimodal stack (Gemma3Model) that builds
    the text tower's masks, where packed attention takes over; ``image_blocks``: its argument marking image tokens
    that attend both ways (a batch with any keeps transformers' mask)."""
    from foak.patching.packed_attention import packed_attention_rule

    text_model = text_model or getattr(modeling, f"{prefix}Model")
    causal_lm = causal_lm or getattr(modeling, f"{prefix}ForCausalLM")
    return [rms_norm_rule(arch, getattr(modeling, f"{prefix}RMSNorm"), mode="gemma"),
            rms_norm_recompute_rule(arch, text_model),
            rope_rule(arch, getattr(modeling, f"{prefix}Attention")),
            glu_mlp_rule(arch, getattr(modeling, f"{prefix}MLP")),
            *causal_lm_rules(arch, causal_lm, final_softcap=final_softcap),
            packed_attention_rule(arch, multimodal_model or text_model, text_config=multimodal_model is not None,
                                  image_blocks=image_blocks)]


def rules():
    return gemma_rules("gemma", modeling, "Gemma")


def gemma4_rules(arch: str, modeling, causal_lm: type, multimodal_model: type | None = None):
    """Gemma 4 (text tower Gemma4TextModel): its RMSNorms (weights in fp32, ``mode="olmo"``; the norms without
    a scale, v_norm and the router's, with a unit weight), the GeGLU MLPs (double-wide ones included), the
    experts of its MoE blocks (fast_moe), RoPE (one tensor per call: q, then k where the layer has its own),
    the fused loss with the final-logit softcap, packed attention."""
    from foak.patching.moe import moe_experts_rule
    from foak.patching.packed_attention import packed_attention_rule

    text_model = modeling.Gemma4TextModel
    return [rms_norm_rule(arch, modeling.Gemma4RMSNorm, mode="olmo"),
            rms_norm_recompute_rule(arch, text_model),
            rope_rule(arch, modeling.Gemma4TextAttention, one_tensor=True),
            glu_mlp_rule(arch, modeling.Gemma4TextMLP),
            moe_experts_rule(arch, modeling, "Gemma4TextExperts"),
            *causal_lm_rules(arch, causal_lm, final_softcap=True),
            packed_attention_rule(arch, multimodal_model or text_model, text_config=multimodal_model is not None,
                                  image_blocks="mm_token_type_ids" if multimodal_model is not None else None)]
