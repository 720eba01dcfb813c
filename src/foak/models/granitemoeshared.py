"""GraniteMoE-Shared: GraniteMoE's rules (RMSNorm, RoPE, loss divided by logits_scaling, the routed experts
GraniteMoeSharedExperts as foak's MoE implementation through ``fast_moe``: transformers' experts interface,
foak.patching.moe; router and auxiliary loss transformers') plus the shared expert (GraniteMoeSharedMLP):
``output_linear(act(g) * u)`` with ``g, u = input_linear(x).chunk(2)`` through the fused gate/up MLP rule
(act and product fused, the product not kept for the backward when output_linear is a plain nn.Linear;
input_linear runs its own forward: a PEFT LoRA layer over it is fused_lora's)."""

from transformers.models.granitemoeshared import modeling_granitemoeshared as modeling

from foak.patching import replacements
from foak.patching.moe import moe_experts_rule


def rules():
    rules = replacements.decoder_rules("granitemoeshared", modeling, "GraniteMoeShared", gated_mlp=False,
                                       logits_divisor="logits_scaling")
    shared = replacements.fused_glu_mlp_rule("granitemoeshared", modeling.GraniteMoeSharedMLP,
                                             gate_up="input_linear", down="output_linear")
    return [*rules, shared, moe_experts_rule("granitemoeshared", modeling, "GraniteMoeSharedExperts")]
