"""OLMo 2: RMSNorm in "olmo" mode (``(weight * normalised).to(input dtype)``) for the post-attention /
post-feedforward norms and the q_norm / k_norm over the whole q / k projection, RoPE (cos/sin stay fp32, q and k
come back in their own dtype, as OLMo's function returns them), SwiGLU MLP, loss."""

from transformers.models.olmo2 import modeling_olmo2 as modeling

from foak.patching.replacements import decoder_rules


def rules():
    return decoder_rules("olmo2", modeling, "Olmo2", norm_mode="olmo", rope_input_dtype=True)
