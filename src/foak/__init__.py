"""foak — Fused Operations And Kernels for fine-tuning LLMs in the HuggingFace stack."""

from foak.backend import get_backend, set_backend
from foak.ops import cross_entropy, geglu, linear_cross_entropy, rms_norm, rope, swiglu

__version__ = "0.1.0"
__all__ = [
    "__version__",
    "cross_entropy",
    "geglu",
    "get_backend",
    "linear_cross_entropy",
    "rms_norm",
    "rope",
    "set_backend",
    "swiglu",
]
