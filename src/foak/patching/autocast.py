"""One autocast cast of a block's input for all its projections, where that cast is the projections' own.

Under autocast over fp32 weights (HF Trainer's ``bf16=True`` on an fp32 model) the residual stream and the
RMSNorm outputs are fp32, and every projection that reads a norm output casts it to the autocast dtype
itself: q, k and v make three bf16 copies of the same tensor, gate and up two, and each copy is saved for
the backward, where each gradient is cast back to fp32 and the three are summed in fp32. The attention
and MLP rules hand their projections the input cast once instead: the projections compute exactly the
same values (the cast is the one autocast would make), one copy is saved instead of three or two, and the
backward casts one summed gradient back (the projections' input gradients are then summed in the autocast
dtype, as they are for bf16 weights, rather than in fp32). Measured on the H200: docs/bench.md (the autocast row).

That holds only for projections whose first operation on the input is autocast's cast and whose result
does not depend on the input's dtype otherwise: a plain ``nn.Linear``, or PEFT's ``lora.Linear`` over one.
A quantized layer is no autocast op: bitsandbytes' ``Linear4bit`` (and foak's ``GPTQLinear``) casts the
input to its compute dtype and returns its result in the input's dtype, and PEFT's ``lora.bnb.Linear4bit``
adds the adapter's output in that dtype; a bf16 input would make a QLoRA model's q/k/v and MLP
intermediates bf16 where PEFT's are fp32. So the input is cast only when every projection that reads it is
of the first kind (checked per call: PEFT may wrap a layer after foak patched the model); a QLoRA block keeps
the fp32 input, and foak's fused LoRA ops cast it once inside (foak.ops.lora).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
from torch import nn


def casts_like_linear(module) -> bool:
    """``module`` is an ``nn.Linear`` (exactly: no subclass such as a quantized layer), or PEFT's
    ``lora.Linear`` over one: an input cast to the autocast dtype beforehand gives the same result."""
    if type(module) is nn.Linear:
        return True
    lora = sys.modules.get("peft.tuners.lora.layer")
    return (lora is not None and type(module) is lora.Linear
            and type(getattr(module, "base_layer", None)) is nn.Linear)


def cast_for_projections(x, projections: Sequence[nn.Module]):
    """``x`` in the autocast dtype when autocast is on for its device, x is fp32 and every module of
    ``projections`` (the ones that read x) casts like ``nn.Linear`` (:func:`casts_like_linear`); else ``x``
    itself."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        return x
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return x
    if not projections or not all(casts_like_linear(p) for p in projections):
        return x
    return x.to(torch.get_autocast_dtype(device_type))


def cast_first_argument(args: tuple, kwargs: dict, projections: Sequence[nn.Module],
                        name: str = "hidden_states") -> tuple[tuple, dict]:
    """(args, kwargs) of a forward call with its input (positional or ``name=``) cast as above."""
    if args:
        return (cast_for_projections(args[0], projections), *args[1:]), kwargs
    if name in kwargs:
        return args, {**kwargs, name: cast_for_projections(kwargs[name], projections)}
    return args, kwargs
