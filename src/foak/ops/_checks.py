"""Input validation shared by the ops: every failure is a ValueError saying what was expected."""

from __future__ import annotations

import sys

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_not_sharded(op: str, name: str, t: object) -> None:
    """A DTensor (e.g. a parameter FSDP2's fully_shard holds sharded between forwards) is refused: its local
    shard is not the tensor, and the kernels read raw memory. Inside the forward of the module that owns it
    (or of an ancestor that fully_shard wrapped) FSDP2 hands out the gathered plain tensor."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)  # no DTensor without it
    if dtensor is not None and isinstance(t, dtensor):
        raise ValueError(
            f"{op}: {name} is a DTensor (placements {tuple(t.placements)}, local shard {tuple(t.to_local().shape)} "
            f"of {tuple(t.shape)}), e.g. a parameter FSDP2 keeps sharded outside its module's forward; foak's ops "
            "take plain tensors: call the op inside the forward of the module that owns the parameter (where "
            "fully_shard has gathered it), or pass t.full_tensor()")


def check_float_tensor(op: str, name: str, t: object, dtypes=FLOAT_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    check_not_sharded(op, name, t)
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{op}: {name} has dtype {t.dtype}; expected one of {names}")


def check_same_device(op: str, **tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"{op}: all tensors must be on one device; got {listing}")


def check_same_dtype(op: str, **tensors: torch.Tensor) -> None:
    dtypes = {name: t.dtype for name, t in tensors.items() if t is not None}
    if len(set(dtypes.values())) > 1:
        listing = ", ".join(f"{n}={d}" for n, d in dtypes.items())
        raise ValueError(f"{op}: tensors must share one dtype; got {listing}")


def rows_view(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """A 2-D [rows, n_cols] view with unit column stride and one row stride (copying only if needed)."""
    t2 = t.reshape(-1, n_cols) if t.dim() != 2 else t
    if t2.stride(-1) != 1 or (t2.shape[0] > 1 and t2.stride(0) < n_cols):
        t2 = t2.contiguous()
    return t2
