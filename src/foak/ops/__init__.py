"""foak's fused ops. Each module holds one op: its torch reference, Triton kernels, launchers,
autograd/custom-op glue and the public function. No transformers import anywhere below this package."""

from foak.ops.activations import geglu, geglu_reference, glu, glu_reference, swiglu, swiglu_reference
from foak.ops.cross_entropy import cross_entropy, cross_entropy_reference
from foak.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from foak.ops.rms_norm import rms_norm, rms_norm_reference
from foak.ops.rope import rope, rope_reference

__all__ = [
    "cross_entropy",
    "cross_entropy_reference",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
    "geglu",
    "geglu_reference",
    "glu",
    "glu_reference",
    "rms_norm",
    "rms_norm_reference",
    "rope",
    "rope_reference",
    "swiglu",
    "swiglu_reference",
]
