"""foak under DDP and FSDP2 (``accelerate launch``, ``torchrun``, or your own ``fully_shard`` calls).

foak needs nothing from the launcher: every rank patches its own model (before or after the wrapping),
and each rule reads a module's parameters only inside that module's forward, where FSDP2 has gathered
them (the fused loss runs inside the LM head's forward for that reason; foak's ops refuse a DTensor with a
ValueError rather than read a shard). This module holds the small helpers foak's CLI, tests and benchmarks
share:

- :func:`rank`, :func:`world_size`, :func:`is_main_process`: where this process stands, from
  torch.distributed once it is initialised, else from the launcher's environment (``RANK``,
  ``WORLD_SIZE``), so they answer before accelerate has set anything up;
- :func:`shard_model`: ``fully_shard`` the way accelerate's FSDP2 plugin does it for a transformers model
  (each decoder layer, the final norm with the LM head, then the root), with the switch accelerate leaves
  out (``reshard_after_forward`` of the head's unit) and bitsandbytes' 4-bit weights kept out of sharding;
- :func:`fsdp2_ignored_params`: those 4-bit weights (integer storage: FSDP2's DTensor conversion would drop
  their ``quant_state``), replicated on every rank, never cast by a ``MixedPrecisionPolicy``.
"""

from __future__ import annotations

import os

import torch
from torch import nn


def _initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank() -> int:
    """This process's global rank (0 without a launcher)."""
    if _initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    if _initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    return rank() == 0


def fsdp2_ignored_params(model: nn.Module) -> set[nn.Parameter]:
    """bitsandbytes ``Params4bit`` weights with integer storage (the default uint8): FSDP2 would turn them
    into DTensors without their ``quant_state``. Kept out of sharding they stay whole on every rank (4 bits
    per weight), with their quant state, and no mixed-precision policy casts them. (accelerate's FSDP2
    preparation leaves them out the same way.)"""
    return {p for p in model.parameters()
            if type(p).__name__ == "Params4bit" and not p.requires_grad and not p.is_floating_point()}


def _decoder_layers(model: nn.Module, layer_classes) -> list[nn.Module]:
    names = set(layer_classes or getattr(model, "_no_split_modules", None) or [])
    if not names:  # e.g. a PeftModel: its base model knows
        base = getattr(model, "get_base_model", lambda: None)()
        names = set(getattr(base, "_no_split_modules", None) or [])
    if not names:
        raise ValueError(f"shard_model: {type(model).__name__} names no decoder layer classes (_no_split_modules);"
                         " pass layer_classes=['MyDecoderLayer']")
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"shard_model: no module of class {sorted(names)} in {type(model).__name__}")
    return layers


def shard_model(model: nn.Module, *, mesh=None, reshard_after_forward: bool = True,
                head_reshard_after_forward: bool | None = False, mp_policy=None, layer_classes=None) -> nn.Module:
    """``fully_shard`` a transformers causal LM (or a PeftModel around one) as accelerate's FSDP2 plugin
    does: each decoder layer (``_no_split_modules``, or ``layer_classes``) with ``reshard_after_forward``; the
    final norm and the LM head as one unit (with the input embedding when tied to the head) with
    ``head_reshard_after_forward`` (accelerate: False; True frees the head between its forward and the
    backward; None: don't give them a unit of their own); the root last. bitsandbytes 4-bit weights are left
    out (:func:`fsdp2_ignored_params`). ``mp_policy``: a ``MixedPrecisionPolicy`` (default: none). Returns the
    model (now an FSDPModule). Patch it with foak before or after: both work."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    ignored = fsdp2_ignored_params(model)
    if ignored:
        kwargs["ignored_params"] = ignored
    for layer in _decoder_layers(model, layer_classes):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    if head_reshard_after_forward is not None:
        base = getattr(model, "get_base_model", lambda: model)()
        head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
        embed = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
        tied = head is not None and embed is not None and getattr(head, "weight", None) is getattr(embed, "weight", 0)
        inner = getattr(base, "model", None)
        norm = getattr(inner, "norm", None) or getattr(inner, "final_layernorm", None) or getattr(inner, "ln_f", None)
        tail = [m for m in ((embed,) if tied else ()) + (norm, head) if m is not None and not isinstance(m, FSDPModule)]
        if tail:
            fully_shard(tail, reshard_after_forward=head_reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)  # the root: torch's default (no resharding after the forward)
    return model
