"""Quantized base models for LoRA fine-tuning (module level: layers, quantizers, checkpoint loaders).

This layer builds on :mod:`foak.ops` (the kernels) and may import ``torch.nn``, safetensors and transformers;
foak.ops never imports it.
"""

from foak.quant.gptq import (
    GPTQLinear,
    gptq_error_report_model,
    load_gptq,
    quantize_model_gptq,
    save_gptq,
)

__all__ = ["GPTQLinear", "gptq_error_report_model", "load_gptq", "quantize_model_gptq", "save_gptq"]
