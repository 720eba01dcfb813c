"""Which implementation runs an op: the Triton kernels or the pure-torch reference.

`auto` (the default) picks Triton when the tensors are on a CUDA device or when the Triton
interpreter is on (``TRITON_INTERPRET=1``), and the reference otherwise (e.g. CPU tensors without the
interpreter). A user can force either with :func:`set_backend` or the ``FOAK_BACKEND`` environment
variable. The choice is made per call from the inputs alone, so it never changes in the middle of a
training run whose tensors stay on one device. :func:`policy` and :func:`runs_on` say in words what the
current setting runs (foak's PatchReport prints them when it is printed, not when the model was patched).
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "reference")
_forced: str | None = None


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def set_backend(name: str | None) -> None:
    """Force every op onto ``"triton"`` or ``"reference"``; ``"auto"`` or ``None`` restores the default."""
    global _forced
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown foak backend {name!r}; expected one of {BACKENDS}")
    _forced = None if name in (None, "auto") else name


def get_backend() -> str:
    if _forced is not None:
        return _forced
    name = os.environ.get("FOAK_BACKEND", "auto")
    if name not in BACKENDS:
        raise ValueError(f"FOAK_BACKEND={name!r} is not valid; expected one of {BACKENDS}")
    return name


def triton_available_for(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and interpreter_enabled())


def use_triton(device: torch.device) -> bool:
    """True if the Triton kernels serve tensors on ``device`` under the current backend setting."""
    backend = get_backend()
    if backend == "reference":
        return False
    available = triton_available_for(device)
    if backend == "triton" and not available:
        raise ValueError(
            f"foak backend is forced to 'triton' but tensors are on {device}: Triton needs a CUDA device "
            "or TRITON_INTERPRET=1 (set before foak is imported). Use set_backend('auto') to fall back "
            "to the reference ops."
        )
    return available


def describe(device: torch.device) -> str:
    """Name of the backend that runs for ``device`` ("triton", "triton-interpreter" or "reference")."""
    if not use_triton(device):
        return "reference"
    return "triton-interpreter" if device.type == "cpu" else "triton"


_NAMES = {"triton": "triton", "triton-interpreter": "triton (interpreter)", "reference": "reference"}


def runs_on(device: torch.device | str) -> str:
    """What runs ops on ``device`` now, in words: "triton on cuda", "triton (interpreter) on cpu",
    "reference on cpu (forced)"... A forced 'triton' that cannot serve the device says so instead of raising."""
    device = torch.device(device)
    forced = "" if get_backend() == "auto" else " (forced)"
    try:
        name = describe(device)
    except ValueError:
        return f"error on {device.type}: backend forced to 'triton', which needs CUDA or TRITON_INTERPRET=1"
    return f"{_NAMES[name]} on {device.type}{forced}"


def policy() -> str:
    """The current dispatch setting in words, e.g. "auto: triton on CUDA, reference on CPU"."""
    backend = get_backend()
    if backend == "reference":
        return "reference (forced)"
    cpu = "triton (interpreter)" if interpreter_enabled() else ("error" if backend == "triton" else "reference")
    head = "triton (forced)" if backend == "triton" else "auto"
    return f"{head}: triton on CUDA, {cpu} on CPU" + (", reference on other devices" if backend == "auto" else "")
