"""GraniteMoE-Shared: GraniteMoE's rules (RMSNorm, RoPE, loss divided by logits_scaling, the routed experts
GraniteMoeSharedExperts as foak's MoE implementation through ``fast_moe``: transformers' experts interface,
foak.patching.moe; router and auxiliary loss transformers') plus the shared expert (GraniteMoeSharedMLP):
``output_linear(act(g) * u)`` with ``g, u = input_linear(x).chunk(2)``, act and product fused, the product
not kept for the backward when output_linear is a plain nn.Linear (foak.ops.glu_linear). input_linear runs
its own forward (a PEFT LoRA layer over it is fused_lora's)."""

from transformers.models.granitemoeshared import modeling_granitemoeshared as modeling

from foak.patching import replacements
from foak.patching.moe import moe_experts_rule
from foak.patching.rules import Rule, Trigger


def shared_mlp_rule(arch: str, mlp_class: type) -> Rule:
    def skip_reason(model):
        act = replacements._hidden_act(model)
        if act not in replacements.GLU_ACTIVATIONS:
            return f"hidden_act {act!r} has no fused gated kernel (supported: {sorted(replacements.GLU_ACTIVATIONS)})"
        return None

    def patch(module, model, state):
        activation = replacements.GLU_ACTIVATIONS[replacements._hidden_act(model)]

        def forward(self, hidden_states):
            x = replacements.cast_for_projections(hidden_states, (self.input_linear,))
            g, u = self.input_linear(x).chunk(2, dim=-1)
            out = self.output_linear
            if replacements._plain_linear(out):  # the product is recomputed in the backward instead of kept
                return replacements.glu_linear(g, u, out.weight, out.bias, activation)
            return out(replacements.glu(g, u, activation))  # e.g. a PEFT LoRA layer: its own forward

        return forward

    has_projections = lambda m, model: all(hasattr(m, p) for p in ("input_linear", "output_linear"))
    return Rule(f"{arch}.swiglu", "swiglu", Trigger(mlp_class, predicate=has_projections), patch, skip_reason)


def rules():
    rules = replacements.decoder_rules("granitemoeshared", modeling, "GraniteMoeShared", gated_mlp=False,
                                       logits_divisor="logits_scaling")
    return [*rules, shared_mlp_rule("granitemoeshared", modeling.GraniteMoeSharedMLP),
            moe_experts_rule("granitemoeshared", modeling, "GraniteMoeSharedExperts")]
