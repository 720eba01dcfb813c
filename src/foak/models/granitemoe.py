"""GraniteMoE: RMSNorm, RoPE, loss (logits_scaling commutes with the fused head). The experts wait
for foak's MoE kernels; the auxiliary loss stays in the HF forward."""

from transformers.models.granitemoe import modeling_granitemoe as modeling

from foak.patching.replacements import decoder_rules


def rules():
    return decoder_rules("granitemoe", modeling, "GraniteMoe", gated_mlp=False)
