"""foak's fused ops. Each module holds one op: its torch reference, Triton kernels, launchers,
autograd/custom-op glue and the public function. No transformers import anywhere below this package.

``foak.ops.<name>`` is always the module named <name>: a function that shares its module's name
(``rms_norm``, ``rope``, ``glu_linear``, ``lora_glu_linear``, ``cross_entropy``, ``linear_cross_entropy``)
is not re-exported here; import it from its module (``from foak.ops.rms_norm import rms_norm``) or use the
top-level ``foak.rms_norm``. The other public functions are re-exported here.
"""

from foak.ops.activations import geglu, geglu_reference, glu, glu_reference, swiglu, swiglu_reference
from foak.ops.glu_linear import glu_linear_reference
from foak.ops.gptq import (
    GPTQWeight,
    gptq_dequantize,
    gptq_dequantize_reference,
    gptq_error_report,
    gptq_group_index,
    gptq_quantize_rtn,
)
from foak.ops.gptq_matmul import gptq_linear, gptq_matmul_reference
from foak.ops.lora import lora_dropout_mask, lora_linear, lora_linear_reference, lora_linears
from foak.ops.lora_glu_linear import lora_glu_linear_reference
from foak.ops.moe import moe_experts, moe_experts_reference
from foak.ops.nf4 import NF4Weight, nf4_dequantize, nf4_dequantize_reference
from foak.ops.rms_norm import rms_norm_reference
from foak.ops.rope import rope_reference

__all__ = [
    "GPTQWeight",
    "NF4Weight",
    "geglu",
    "geglu_reference",
    "glu",
    "glu_linear_reference",
    "glu_reference",
    "gptq_dequantize",
    "gptq_dequantize_reference",
    "gptq_error_report",
    "gptq_group_index",
    "gptq_linear",
    "gptq_matmul_reference",
    "gptq_quantize_rtn",
    "lora_dropout_mask",
    "lora_glu_linear_reference",
    "lora_linear",
    "lora_linear_reference",
    "lora_linears",
    "moe_experts",
    "moe_experts_reference",
    "nf4_dequantize",
    "nf4_dequantize_reference",
    "rms_norm_reference",
    "rope_reference",
    "swiglu",
    "swiglu_reference",
]
