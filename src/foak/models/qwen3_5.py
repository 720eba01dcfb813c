"""Qwen3.5 (hybrid: gated-delta-net linear-attention layers and gated full-attention layers). This file holds
the family's rules (qwen3_5_text, qwen3_5_moe and qwen3_5_moe_text use ``hybrid_rules`` too) and serves
``qwen3_5``: the multimodal ``Qwen3_5ForConditionalGeneration`` (``AutoModelForImageTextToText``) over a
``Qwen3_5Config`` with a ``text_config``. ``AutoModelForCausalLM`` on the same checkpoint loads
``Qwen3_5ForCausalLM`` over the text config, whose model_type is ``qwen3_5_text`` (foak.models.qwen3_5_text).

foak's: the zero-centred RMSNorms (``(1 + w)``, cast after the product: rms_norm mode "gemma"; also the
per-head q_norm/k_norm), the gated delta net's gated RMSNorm (rms_norm + glu: rms_norm_gated_rule), RoPE of the
full-attention layers (``apply_rotary_pos_emb`` rotates the first ``partial_rotary_factor`` of each head:
foak's rope with partial rotary; the multimodal rope's interleaved ``mrope_section`` layout is built by the
rotary-embedding module, which stays transformers', so the rotation foak computes is the same math for text
and vision positions), the SwiGLU MLP, the loss. transformers': the gated delta net itself (conv, delta-rule
recurrence, its projections), the attention's sigmoid output gate, the vision tower.

Packed batches (position ids restarting inside a row, no attention mask): foak's packed attention computes
the full-attention layers per sequence, as transformers' block-causal mask does. The linear-attention layers
are transformers' own: given only position ids they run across the sequence boundaries (conv and recurrent
state carry over), patched or not; transformers keeps them apart only with flash-linear-attention and the
``cu_seq_lens_q`` of a flattening collator. The packed_attention row says so.
"""

import dataclasses

from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

from foak.patching.packed_attention import packed_attention_rule
from foak.patching.replacements import (causal_lm_rules, glu_mlp_rule, rms_norm_gated_rule, rms_norm_recompute_rule,
                                        rms_norm_rule, rope_rule)

PACKED_NOTE = ("the linear-attention (gated delta net) layers are transformers' own: given position_ids alone "
               "they carry their state across packed sequences, patched or not (only full-attention layers keep "
               "them apart)")


def hybrid_rules(arch: str, modeling, prefix: str, causal_lm: str, mlp: str) -> list:
    """The rules of a Qwen3.5-style hybrid decoder whose modeling module defines <prefix>RMSNorm,
    <prefix>RMSNormGated, <prefix>TextModel, <prefix>Attention, the gated MLP class ``mlp`` and the causal LM
    class ``causal_lm``."""
    stack = getattr(modeling, f"{prefix}TextModel")
    packed = packed_attention_rule(arch, stack)
    return [rms_norm_rule(arch, getattr(modeling, f"{prefix}RMSNorm"), mode="gemma"),
            rms_norm_gated_rule(arch, getattr(modeling, f"{prefix}RMSNormGated")),
            rms_norm_recompute_rule(arch, stack),
            rope_rule(arch, getattr(modeling, f"{prefix}Attention")),
            glu_mlp_rule(arch, getattr(modeling, mlp)),
            *causal_lm_rules(arch, getattr(modeling, causal_lm)),
            dataclasses.replace(packed, describe=lambda model: PACKED_NOTE)]


def rules():
    return hybrid_rules("qwen3_5", modeling, "Qwen3_5", "Qwen3_5ForConditionalGeneration", "Qwen3_5MLP")
