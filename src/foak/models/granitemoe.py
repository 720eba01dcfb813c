"""GraniteMoE: RMSNorm, RoPE, loss (the fused head divides its logits by logits_scaling), and the experts
(GraniteMoeExperts, the same [E, 2I, H] / [E, H, I] layout as Mixtral's) as foak's MoE implementation
(``fast_moe``: transformers' experts interface, foak.patching.moe). The router (top-k on the logits, then
softmax) and the auxiliary loss stay in the HF forward."""

from transformers.models.granitemoe import modeling_granitemoe as modeling

from foak.patching.moe import moe_experts_rule
from foak.patching.replacements import decoder_rules


def rules():
    return [*decoder_rules("granitemoe", modeling, "GraniteMoe", gated_mlp=False,
                          logits_divisor="logits_scaling"),
            moe_experts_rule("granitemoe", modeling, "GraniteMoeExperts")]
