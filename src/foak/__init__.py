"""foak — Fused Operations And Kernels for fine-tuning LLMs in the HuggingFace stack."""

from foak.backend import get_backend, set_backend
from foak.ops.activations import geglu, swiglu
from foak.ops.cross_entropy import cross_entropy
from foak.ops.glu_linear import glu_linear
from foak.ops.linear_cross_entropy import linear_cross_entropy
from foak.ops.lora import lora_linear, lora_linears
from foak.ops.lora_glu_linear import lora_glu_linear
from foak.ops.rms_norm import rms_norm
from foak.ops.rope import rope
from foak.patching import patch, restore
import foak.integrations.trl  # noqa: F401,E402  (registers foak's server for TRL's fused LM head)
import foak.integrations.trl_distill  # noqa: F401,E402  (and for TRL's distillation loss)

__version__ = "0.1.0"
__all__ = [
    "__version__",
    "cross_entropy",
    "geglu",
    "get_backend",
    "glu_linear",
    "linear_cross_entropy",
    "lora_glu_linear",
    "lora_linear",
    "lora_linears",
    "patch",
    "restore",
    "rms_norm",
    "rope",
    "set_backend",
    "swiglu",
]
