"""Llama-4 text (``Llama4ForCausalLM``, config ``Llama4TextConfig``, model_type ``llama4_text``: what
``AutoModelForCausalLM`` builds from a Llama-4 checkpoint): RMSNorm, the SwiGLU MLPs (the dense layers' and each
MoE layer's shared expert), loss, and the routed experts through foak's ``moe_experts`` op.

Llama4TextExperts does not use transformers' experts interface: the MoE block (Llama4TextMoe) scales each token
by its router score *before* the experts (``routed_in = x * sigmoid(top-k logit)``, zero for the experts not
chosen, whose outputs are then exactly zero) and sums the experts' outputs. foak's rule replaces the block's
forward: HF's router runs as it is (its top-k taken again from its logits, the same ``torch.topk`` call), the
chosen pairs' inputs ``x[t] * score[t, e]`` go through ``moe_experts`` as one-expert rows with weight 1 (the
weights ``[E, H, 2I]`` / ``[E, I, H]`` passed as transposed views), their outputs are summed per token and
added to the shared expert's. The same products, GEMMs and sums as HF's, without running every expert on
every token.

What stays transformers': the RoPE (a complex multiply on interleaved pairs, ``apply_rotary_emb`` with
``freqs_cis``: foak's rope op takes rotate_half cos/sin), the qk-norm (Llama4TextL2Norm: no weight), the
temperature tuning of the NoPE layers, and packed batches' attention (the decoder layer does not pass
``position_ids`` to its attention, where foak's packed path reads the sequences).
"""

import torch
from torch import nn
from transformers.models.llama4 import modeling_llama4 as modeling

from foak.patching import moe as moe_patching
from foak.patching.replacements import (causal_lm_rules, glu_mlp_rule, rms_norm_recompute_rule,
                                        rms_norm_rule)
from foak.patching.rules import Rule, Skip, Trigger, call_next

ARCH = "llama4_text"


def _support(block) -> str | None:
    """None when foak's forward computes exactly this Llama4TextMoe's, else why not."""
    experts, router = getattr(block, "experts", None), getattr(block, "router", None)
    if not isinstance(experts, modeling.Llama4TextExperts):
        return (f"the experts module is a {type(experts).__name__}, not Llama4TextExperts (e.g. PEFT LoRA on "
                "the experts' weights: target_parameters)")
    if not isinstance(router, modeling.Llama4Router):
        return f"the router is a {type(router).__name__}, not Llama4Router"
    if "forward" in vars(experts) or experts._forward_hooks or experts._forward_pre_hooks:
        return "the experts module has a replaced forward or hooks (foak's forward does not call it)"
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    for name, w in (("gate_up_proj", gate_up), ("down_proj", down)):
        if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() != 3:
            return f"{name} is not a 3-d floating-point tensor ({type(w).__name__})"
        if type(w) not in (torch.Tensor, nn.Parameter):
            return f"{name} is a {type(w).__name__} (sharded or quantized expert weights)"
    E, H, two_i = gate_up.shape
    if two_i % 2 or tuple(down.shape) != (E, two_i // 2, H):
        return (f"expert weights of shapes {tuple(gate_up.shape)} / {tuple(down.shape)} (foak takes "
                "Llama4TextExperts' [E, H, 2I] / [E, I, H])")
    return moe_patching.activation_of(getattr(experts, "act_fn", None))[1]


def moe_block_rule(block_class: type) -> Rule:
    rule_id = f"{ARCH}.moe"

    def patch(module, model, state):
        reason = _support(module)
        if reason is not None:
            return Skip(reason)
        counts = moe_patching._counts_of(state, rule_id)

        def forward(self, hidden_states):
            reason = _support(self)
            if reason is not None:
                out = call_next(self, rule_id, hidden_states)
                counts.count(reason, "Llama4TextMoe.forward")
                return out
            experts = self.experts
            activation, _ = moe_patching.activation_of(experts.act_fn)
            x = hidden_states.reshape(-1, self.hidden_dim)
            router_scores, router_logits = self.router(x)  # [T, E]: sigmoid of the top-k logits, 0 elsewhere
            top_k_index = torch.topk(router_logits, self.router.top_k, dim=1).indices  # the router's own choice
            scores = router_scores.gather(1, top_k_index)  # [T, k]
            T, K = top_k_index.shape
            routed_in = (x[:, None, :] * scores[:, :, None]).reshape(T * K, -1)  # HF: x * score, on the input
            routed_out = moe_patching.moe_experts(
                routed_in, top_k_index.reshape(T * K, 1), routed_in.new_ones(T * K, 1),
                experts.gate_up_proj.transpose(1, 2), experts.down_proj.transpose(1, 2), activation=activation)
            counts.count(None, "Llama4TextMoe.forward")
            out = self.shared_expert(x)
            return out + routed_out.to(out.dtype).view(T, K, -1).sum(dim=1), router_logits

        return forward

    return Rule(rule_id, "moe", Trigger(block_class), patch)


def _not_served(rule_id: str, switch: str, module_class: type, why: str) -> Rule:
    return Rule(rule_id, switch, Trigger(module_class), lambda module, model, state: Skip(why),
                lambda model: why)


def rules():
    return [rms_norm_rule(ARCH, modeling.Llama4TextRMSNorm),
            rms_norm_recompute_rule(ARCH, modeling.Llama4TextModel),
            _not_served(f"{ARCH}.rope", "rope", modeling.Llama4TextAttention,
                        "complex-multiply RoPE on interleaved pairs (apply_rotary_emb with freqs_cis); foak's rope "
                        "op takes rotate_half cos/sin"),
            _not_served(f"{ARCH}.qk_norm", "rms_norm", modeling.Llama4TextL2Norm,
                        "Llama4TextL2Norm has no weight; foak's rms_norm takes one"),
            glu_mlp_rule(ARCH, modeling.Llama4TextMLP),
            *causal_lm_rules(ARCH, modeling.Llama4ForCausalLM),
            _not_served(f"{ARCH}.packed_attention", "packed_attention", modeling.Llama4TextModel,
                        "Llama4TextDecoderLayer does not pass position_ids to its attention, where foak's packed "
                        "path reads the sequences (and chunked-attention layers would need a chunked mask)"),
            moe_block_rule(modeling.Llama4TextMoe)]
