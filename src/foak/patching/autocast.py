"""One autocast cast of a block's input for all its projections.

Under autocast over fp32 weights (HF Trainer's ``bf16=True`` on an fp32 model) the residual stream and the
RMSNorm outputs are fp32, and every projection that reads a norm output casts it to the autocast dtype
itself: q, k and v make three bf16 copies of the same tensor, gate and up two, and each copy is saved for
the backward, where each gradient is cast back to fp32 and the three are summed in fp32. The attention
and MLP rules hand their projections the input cast once instead: the projections compute exactly the
same values (the cast is the one autocast would make), one copy is saved instead of three or two, and the
backward casts one summed gradient back (the projections' input gradients are then summed in the autocast
dtype, as they are for bf16 weights, rather than in fp32). Measured on the H200: see the README.
"""

from __future__ import annotations

import torch


def cast_for_projections(x):
    """``x`` in the autocast dtype when autocast is on for its device and x is fp32; else ``x`` itself."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        return x
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return x
    return x.to(torch.get_autocast_dtype(device_type))


def cast_first_argument(args: tuple, kwargs: dict, name: str = "hidden_states") -> tuple[tuple, dict]:
    """(args, kwargs) of a forward call with its input (positional or ``name=``) cast as above."""
    if args:
        return (cast_for_projections(args[0]), *args[1:]), kwargs
    if name in kwargs:
        return args, {**kwargs, name: cast_for_projections(kwargs[name])}
    return args, kwargs
