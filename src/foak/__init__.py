"""foak — Fused Operations And Kernels for fine-tuning LLMs in the HuggingFace stack.

``import foak`` is light (no torch, no transformers): the public names below and the submodules
(``foak.ops``, ``foak.patching``, ...) are imported on first use, so ``foak --help`` and the command line's
argument errors come back at once. ``foak.patch`` imports foak.api, which also registers foak's server
for TRL's fused LM head (foak.integrations.trl)."""

from __future__ import annotations

import importlib
import importlib.util

# public name -> the module that defines it (imported on first access)
_EXPORTS = {
    "cross_entropy": "foak.ops.cross_entropy",
    "geglu": "foak.ops.activations",
    "get_backend": "foak.backend",
    "glu_linear": "foak.ops.glu_linear",
    "linear_cross_entropy": "foak.ops.linear_cross_entropy",
    "lora_glu_linear": "foak.ops.lora_glu_linear",
    "lora_linear": "foak.ops.lora",
    "lora_linears": "foak.ops.lora",
    "patch": "foak.api",
    "restore": "foak.api",
    "rms_norm": "foak.ops.rms_norm",
    "rope": "foak.ops.rope",
    "set_backend": "foak.backend",
    "swiglu": "foak.ops.activations",
}

__all__ = [
    "__version__",
    "cross_entropy",
    "geglu",
    "get_backend",
    "glu_linear",
    "linear_cross_entropy",
    "lora_glu_linear",
    "lora_linear",
    "lora_linears",
    "patch",
    "restore",
    "rms_norm",
    "rope",
    "set_backend",
    "swiglu",
]


def _version() -> str:
    """The installed distribution's version (its metadata, what pip installed); from a source checkout that is
    not installed (PYTHONPATH=src), the version in the checkout's pyproject.toml."""
    from importlib import metadata

    try:
        return metadata.version("foak")
    except metadata.PackageNotFoundError:
        pass
    import re
    from pathlib import Path

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"  # src/foak/__init__.py -> the checkout
    match = re.search(r'(?m)^version\s*=\s*"([^"]+)"', pyproject.read_text()) if pyproject.is_file() else None
    return match.group(1) if match else "0+unknown"


def __getattr__(name: str):
    if name == "__version__":
        value = globals()["__version__"] = _version()
        return value
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")  # a submodule (the import binds it here too)
    raise AttributeError(f"module 'foak' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
