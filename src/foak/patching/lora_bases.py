"""The base layers under PEFT's LoRA layers that foak's fused LoRA ops take, one :class:`BaseFormat` each.

A format says which PEFT LoRA class wraps which base class, why a given base cannot be fused (at patch
time, and per call for the input at hand), and what the ops receive as the frozen weight: the dense
tensor of an ``nn.Linear``, or a quantized weight object (``foak.ops.nf4.NF4Weight`` for bitsandbytes'
NF4 ``Linear4bit``, ``foak.ops.gptq.GPTQWeight`` for foak's ``GPTQLinear`` under ``GPTQLoraLinear``,
foak.quant) that the ops dequantize per GEMM. The library that defines a format stays its owner:
nothing here writes to its modules or parameters. A new base is one more entry of :data:`FORMATS`. bitsandbytes is looked up in ``sys.modules`` only (a model can hold its layers only if
it was imported).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from foak.ops.nf4 import NF4Weight


@dataclass(frozen=True)
class BaseFormat:
    name: str  # shown in the report
    lora_class: Callable[[], type | None]  # PEFT's LoRA layer class for this base (None: not importable)
    base_class: Callable[[], type | None]
    patch_reason: Callable[[nn.Module], str | None]  # why this base can never be fused (None: it can)
    call_reason: Callable[[nn.Module, torch.Tensor], str | None]  # why this call cannot be (None: it can)
    weight: Callable[[nn.Module], object]  # the frozen weight the ops take


def _plain_patch_reason(base):
    return None


def _plain_call_reason(base, x):
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return None
    if base.weight.dtype != x.dtype or (base.bias is not None and base.bias.dtype != x.dtype):
        return "input and base weight dtypes differ"
    return None


PLAIN = BaseFormat(
    "nn.Linear",
    lambda: getattr(sys.modules.get("peft.tuners.lora.layer"), "Linear", None),
    lambda: nn.Linear,
    _plain_patch_reason,
    _plain_call_reason,
    lambda base: base.weight,
)


# bitsandbytes NF4 -----------------------------------------------------------------------------------
def _bnb_lora_class():
    return getattr(sys.modules.get("peft.tuners.lora.bnb"), "Linear4bit", None)


def _bnb_base_class():
    return getattr(sys.modules.get("bitsandbytes.nn"), "Linear4bit", None)


def _nf4_patch_reason(base):
    state = getattr(base.weight, "quant_state", None)
    if state is None:
        return "a Linear4bit without quant_state (not quantized yet: move it to the device first)"
    if state.quant_type != "nf4":
        return f"{state.quant_type} 4-bit quantization (foak dequantizes NF4 only)"
    if getattr(state, "packing_format_for_cpu", False):
        # bitsandbytes rewrites the weight in place for its CPU inference kernel (AVX512-BF16 CPUs, the first
        # eval-mode call without grad): another nibble layout and bf16 scales, not the NF4 storage foak reads
        return "weight repacked by bitsandbytes for its CPU inference kernel (packing_format_for_cpu)"
    if state.nested and state.state2.blocksize != 256:
        return f"nested absmax blocksize {state.state2.blocksize} (256 expected)"
    return None


def _nf4_call_reason(base, x):
    reason = _nf4_patch_reason(base)
    if reason is not None:
        return reason
    state = base.weight.quant_state
    compute = base.compute_dtype or x.dtype
    if state.dtype != compute:
        # bitsandbytes dequantizes to state.dtype, then casts to the compute dtype: a second rounding
        return f"4-bit weight of dtype {state.dtype} computed in {compute}"
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        if compute != torch.get_autocast_dtype(device_type):
            return f"4-bit compute dtype {compute} under {torch.get_autocast_dtype(device_type)} autocast"
    elif x.dtype != compute:
        return f"{x.dtype} input into a 4-bit layer computing in {compute}"
    if base.bias is not None and not torch.is_autocast_enabled(device_type) and base.bias.dtype != x.dtype:
        return "base bias and input dtypes differ"
    return None


_NF4_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _nf4_weight(base) -> NF4Weight:
    """The NF4Weight of a bitsandbytes Linear4bit, built once per quantized storage (a move to another
    device or a re-quantization builds a new one)."""
    data, state = base.weight.data, base.weight.quant_state
    compiling = torch.compiler.is_compiling()  # data pointers cannot be compared while dynamo traces
    key = None if compiling else (data.data_ptr(), data.device, id(state), state.absmax.data_ptr())
    cached = None if compiling else _NF4_CACHE.get(base)
    if cached is not None and cached[0] == key:
        return cached[1]
    packed = data if data.dtype == torch.uint8 else data.view(torch.uint8)
    kwargs = {"code": state.code, "blocksize": state.blocksize}
    if state.nested:
        kwargs.update(nested_absmax=state.state2.absmax, nested_code=state.state2.code,
                      nested_blocksize=state.state2.blocksize, offset=state.offset)
    weight = NF4Weight(packed, state.absmax, tuple(state.shape), state.dtype, **kwargs)
    if not compiling:
        _NF4_CACHE[base] = (key, weight)
    return weight


BNB_NF4 = BaseFormat("bitsandbytes NF4 Linear4bit", _bnb_lora_class, _bnb_base_class, _nf4_patch_reason,
                     _nf4_call_reason, _nf4_weight)

# foak GPTQ ------------------------------------------------------------------------------------------
def _gptq_lora_class():
    return getattr(sys.modules.get("foak.quant.gptq_peft"), "GPTQLoraLinear", None)


def _gptq_base_class():
    return getattr(sys.modules.get("foak.quant.gptq"), "GPTQLinear", None)


def _gptq_call_reason(base, x):
    compute = base.compute_dtype
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        if compute != torch.get_autocast_dtype(device_type):
            return f"GPTQ compute dtype {compute} under {torch.get_autocast_dtype(device_type)} autocast"
        return None
    if x.dtype != compute:
        return f"{x.dtype} input into a GPTQ layer computing in {compute}"
    if base.bias is not None and base.bias.dtype != x.dtype:
        return "base bias and input dtypes differ"
    return None


def _gptq_patch_reason(base):
    # the weight object is validated (a host read of g_idx) and kept now: a first call under torch.compile then
    # finds it instead of building it inside the trace, where that read is a graph break. Not while FSDP2
    # holds the tensors sharded (DTensors): the layer's forward builds it from the gathered ones.
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is None or not any(isinstance(p, dtensor) for p in base.parameters(recurse=False)):
        base.weight_object()
    return None


GPTQ = BaseFormat("foak GPTQ-4bit GPTQLinear", _gptq_lora_class, _gptq_base_class, _gptq_patch_reason,
                  _gptq_call_reason, lambda base: base.weight_object())

FORMATS = (PLAIN, BNB_NF4, GPTQ)


def format_of(module: nn.Module) -> BaseFormat | None:
    """The format of a PEFT LoRA layer whose LoRA class and base class are exactly a format's."""
    for fmt in FORMATS:
        lora_class, base_class = fmt.lora_class(), fmt.base_class()
        if lora_class is not None and type(module) is lora_class and type(getattr(module, "base_layer", None)) is \
                base_class:
            return fmt
    return None
