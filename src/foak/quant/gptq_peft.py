"""PEFT LoRA on :class:`foak.quant.gptq.GPTQLinear` bases.

PEFT (0.21) wraps only the layer types it knows (``nn.Linear``, bitsandbytes, gptqmodel's QuantLinear, ...);
other modules need a LoRA layer class registered on the config through its experimental custom-module
mapping. :class:`GPTQLoraLinear` is that class: the frozen GPTQ base plus PEFT's usual ``lora_A`` /
``lora_B`` / dropout / scaling per adapter (so adapters save, load and switch like any PEFT LoRA), no merging
(the base is quantized). :func:`register_gptq_lora` puts the mapping on a ``LoraConfig``; do it before
``peft.get_peft_model``. The mapping is not saved with the adapter: load a saved adapter with
``foak.quant.load_gptq(<gptq dir>, adapter=<adapter dir>)``, which registers it on the adapter's config for
``PeftModel.from_pretrained``. ``target_modules="all-linear"`` does not find GPTQLinear layers (PEFT looks for
``nn.Linear``): name the targets, e.g. ``["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
"down_proj"]``.
"""

from __future__ import annotations

import torch
from peft.tuners.lora.layer import LoraLayer
from torch import nn

from foak.quant.gptq import GPTQLinear


class GPTQLoraLinear(nn.Module, LoraLayer):
    """LoRA adapters around a frozen :class:`GPTQLinear`: ``base(x) + sum_a scaling_a * B_a(A_a(dropout_a(x)))``."""

    def __init__(self, base_layer: nn.Module, adapter_name: str, config, r: int = 0, lora_alpha: int = 1,
                 **kwargs):
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        self.fan_in_fan_out = False
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config)

    def _get_in_out_features(self, module: nn.Module):
        if not isinstance(module, GPTQLinear):
            raise ValueError(f"GPTQLoraLinear wraps foak GPTQLinear layers, got {type(module).__name__}")
        return module.in_features, module.out_features

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        raise ValueError("GPTQLoraLinear: LoRA adapters cannot be merged into a GPTQ 4-bit base (the merged weight "
                         "would need re-quantization); keep the adapters separate")

    def unmerge(self) -> None:
        raise ValueError("GPTQLoraLinear: nothing to unmerge (adapters on GPTQ bases are never merged)")

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        result = self.base_layer(x)
        if self.disable_adapters:
            return result
        out_dtype = result.dtype
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            lora_A, lora_B = self.lora_A[name], self.lora_B[name]
            h = self._cast_input_dtype(x, lora_A.weight.dtype)
            result = result + lora_B(lora_A(self.lora_dropout[name](h))) * self.scaling[name]
        return result.to(out_dtype)

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


def register_gptq_lora(lora_config):
    """Map GPTQLinear to :class:`GPTQLoraLinear` on ``lora_config`` (a ``peft.LoraConfig``); returns it."""
    from peft import LoraConfig

    if not isinstance(lora_config, LoraConfig):
        raise ValueError(f"register_gptq_lora: expected a peft.LoraConfig, got {type(lora_config).__name__}")
    lora_config._register_custom_module({GPTQLinear: GPTQLoraLinear})
    return lora_config
