"""The acceleration config: which foak kernels to switch on, validated, plus the mixed-precision matrix.

The YAML has two possible stanzas; exactly one of them must be present:

```yaml
training:                       # full fine-tuning
  fused_ops_and_kernels:
    fast_rms_layernorm: true
    fused_linear_loss: true
```

```yaml
peft:                           # LoRA / QLoRA
  quantization:
    fused_ops_and_kernels:
      fused_lora: true
      base_layer: bitsandbytes
```

Every mistake is a ``ValueError`` that says where it is and what to write instead: unknown keys name the
closest valid key, wrong value types name the expected type, and contradictory switches say which one to
drop. Nothing is guessed or silently picked.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

if TYPE_CHECKING:  # (imported where check_precision runs: reading a config needs no torch)
    import torch

__all__ = [
    "FULL_STANZA",
    "PEFT_STANZA",
    "SWITCH_TO_RULE",
    "AccelerationConfig",
    "ConfigFileNotFoundError",
    "check_precision",
    "config_from_kwargs",
    "load_config",
]

FULL_STANZA = "training.fused_ops_and_kernels"
PEFT_STANZA = "peft.quantization.fused_ops_and_kernels"
STANZA_OF_MODE = {"full": FULL_STANZA, "peft": PEFT_STANZA}

# Switch name in the YAML -> rule name the patcher knows. `base_layer` is a setting, not a rule.
SWITCH_TO_RULE = {
    "fast_rms_layernorm": "rms_norm",
    "fast_rope_embeddings": "rope",
    "fast_swiglu": "swiglu",
    "fast_loss": "loss",
    "fused_linear_loss": "fused_linear_loss",
    "fused_lora": "lora",
    "fast_moe": "moe",
    "fast_packed_attention": "packed_attention",
    "offload_activations": "offload_activations",
    "tiled_mlp": "tiled_mlp",
}

# The YAML tree above the switches: every valid key at every level (a stanza is a leaf here).
_TREE: dict[str, Any] = {
    "training": {"fused_ops_and_kernels": None},
    "peft": {"quantization": {"fused_ops_and_kernels": None}},
}

_PRECISION_HINT = "(see the mixed-precision compatibility matrix in foak.config.check_precision)"


class ConfigFileNotFoundError(FileNotFoundError, ValueError):
    """A config path that does not exist. Both a FileNotFoundError and a ValueError."""


class AccelerationConfig(BaseModel):
    """Which foak kernels to apply, for full fine-tuning (``mode="full"``) or LoRA/QLoRA (``mode="peft"``).

    Build it with :func:`load_config` (YAML file or parsed dict) or :func:`config_from_kwargs`.
    Immutable; ``model_copy(update=...)`` does not re-validate, so build a new one instead.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    mode: Literal["full", "peft"]
    fast_rms_layernorm: bool = False
    fast_rope_embeddings: bool = False
    fast_swiglu: bool = False
    fast_loss: bool = False  # cross-entropy kernel on materialised logits
    fused_linear_loss: bool = False  # LM head + loss, never materialises the logits
    fused_lora: bool = False
    fast_moe: bool = False
    # packed batches (position_ids restarting, no attention_mask) attend per sequence through foak's
    # varlen attention; unpacked batches run the previous attention implementation unchanged
    fast_packed_attention: bool = False
    # with fast_packed_attention: the unpacked causal batches that go to SDPA (bf16/fp16, CUDA sm90+, no mask)
    # ask for cuDNN's attention first (flash when cuDNN declines a call; the report counts both)
    cudnn_attention: bool = False
    base_layer: Literal["none", "bitsandbytes", "gptq"] = "none"
    # under gradient checkpointing, the checkpointed layers' inputs live in pinned CPU memory until their
    # recompute (foak.patching.offload); the budget caps the host memory (default: half the available RAM)
    offload_activations: bool = False
    offload_budget_gib: float | None = None
    # the gated MLP in sequence chunks in forward and backward (long context); chunk size in tokens, None: the
    # model's hidden size. Opt-in: one more MLP forward per step
    tiled_mlp: bool = False
    tiled_mlp_chunk_tokens: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_keys_only(cls, data: Any) -> Any:
        # extra="forbid" would reject these too, but without saying what was meant.
        if isinstance(data, Mapping):
            mode = data.get("mode")
            where = STANZA_OF_MODE.get(mode, "AccelerationConfig") if isinstance(mode, str) else "AccelerationConfig"
            errors = _unknown_keys(data, list(cls.model_fields), where)
            if errors:
                raise ValueError("\n".join(errors))
        return data

    @model_validator(mode="after")
    def _consistent(self) -> AccelerationConfig:
        where = self.stanza_path
        if self.fast_loss and self.fused_linear_loss:
            raise ValueError(
                f"fast_loss and fused_linear_loss are both true in {where}; pick one: fused_linear_loss computes "
                "the LM head and the loss together without materialising the logits (less memory, the usual "
                "choice), fast_loss runs the cross-entropy kernel on materialised logits (use it when something "
                "needs the logits)"
            )
        budget = self.offload_budget_gib
        # (YAML's .nan / .inf are floats: without isfinite they reached int() as an unclear error)
        if budget is not None and (not self.offload_activations or not math.isfinite(budget) or budget <= 0):
            raise ValueError(
                f"offload_budget_gib: {budget} in {where}: "
                + ("it must be a positive number of GiB (finite)" if self.offload_activations else
                   "it only applies with offload_activations: true; add that switch or remove the budget"))
        if self.cudnn_attention and not self.fast_packed_attention:
            raise ValueError(f"cudnn_attention: true in {where} works through foak's attention function: add "
                             "fast_packed_attention: true, or remove cudnn_attention")
        if self.tiled_mlp_chunk_tokens is not None:
            if self.tiled_mlp_chunk_tokens <= 0:
                raise ValueError(f"{where}.tiled_mlp_chunk_tokens must be a positive number of tokens, got "
                                 f"{self.tiled_mlp_chunk_tokens}")
            if not self.tiled_mlp:
                raise ValueError(f"tiled_mlp_chunk_tokens is set in {where} but tiled_mlp is off; set tiled_mlp: "
                                 "true, or remove tiled_mlp_chunk_tokens")
        if self.mode == "full":
            if self.fused_lora:
                raise ValueError(
                    f"fused_lora: true in {where}: full fine-tuning has no LoRA adapters / quantized base; "
                    f"remove it, or move the switches to {PEFT_STANZA} for a LoRA/QLoRA run"
                )
            if self.base_layer != "none":
                raise ValueError(
                    f"base_layer: {self.base_layer} in {where}: full fine-tuning has no LoRA adapters / quantized "
                    f"base; remove it (or set it to 'none'), or move the switches to {PEFT_STANZA} for a QLoRA run"
                )
        return self

    @property
    def stanza_path(self) -> str:
        """Dotted path of the YAML stanza this config corresponds to."""
        return STANZA_OF_MODE[self.mode]

    def enabled_rules(self) -> set[str]:
        """Rule names (values of :data:`SWITCH_TO_RULE`) whose switch is on."""
        return {rule for switch, rule in SWITCH_TO_RULE.items() if getattr(self, switch)}

    def to_yaml_dict(self) -> dict[str, Any]:
        """The nested dict (YAML shape) that :func:`load_config` turns back into this config."""
        stanza = self.model_dump(exclude={"mode"})
        node: dict[str, Any] = stanza
        for key in reversed(self.stanza_path.split(".")):
            node = {key: node}
        return node


def _suggest(key: Any, valid: list[str], where: str) -> str:
    """One 'unknown key' message: the closest valid key at this level, else a valid key elsewhere."""
    name = str(key)
    place = f"in {where}" if where else "at the top level"
    close = difflib.get_close_matches(name, valid, n=1)
    if close:
        return f"unknown key {name!r} {place}; did you mean {close[0]!r}? Valid keys here: {', '.join(valid)}"
    # A valid key put at the wrong level (e.g. a switch at the top level): name its full path.
    scored = [(difflib.SequenceMatcher(None, name, p.rsplit(".", 1)[-1]).ratio(), p) for p in _all_paths()]
    best = max((score for score, _ in scored), default=0.0)
    elsewhere = [p for score, p in scored if score >= 0.6 and score == best]
    elsewhere.sort(key=lambda p: not p.startswith(f"{where}."))  # same branch first (stable sort)
    if elsewhere:
        options = " or ".join(repr(p) for p in elsewhere[:2])
        return f"unknown key {name!r} {place}; it belongs at a different level: did you mean {options}?"
    return f"unknown key {name!r} {place}; valid keys here: {', '.join(valid)}"


def _unknown_keys(mapping: Mapping, valid: list[str], where: str) -> list[str]:
    return [_suggest(key, valid, where) for key in mapping if key not in valid]


def _all_paths() -> list[str]:
    paths: list[str] = []

    def walk(tree: dict[str, Any], prefix: str) -> None:
        for key, sub in tree.items():
            path = f"{prefix}{key}"
            paths.append(path)
            if sub is None:
                paths.extend(f"{path}.{switch}" for switch in _SWITCHES)
            else:
                walk(sub, f"{path}.")

    walk(_TREE, "")
    return paths


_SWITCHES = [name for name in AccelerationConfig.model_fields if name != "mode"]


def _expected_type(field: str) -> str:
    annotation = AccelerationConfig.model_fields[field].annotation
    if annotation is bool:
        return "a boolean (true or false)"
    if annotation == (int | None):
        return "a positive integer (or null)"
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(repr(v) for v in get_args(annotation))
    if annotation == float | None:
        return "a number or null"
    return str(annotation)


def _validation_message(err: ValidationError, where: str) -> str:
    """Pydantic's errors rewritten as one line each: the full key path, what was expected, what was given."""
    lines = []
    for e in err.errors():
        if e["type"] == "value_error":  # our own validators: their message is already complete
            lines.append(str(e["ctx"]["error"]))
            continue
        field = ".".join(str(part) for part in e["loc"])
        if field in AccelerationConfig.model_fields:
            value = e["input"]
            lines.append(f"{where}.{field}: expected {_expected_type(field)}, got {type(value).__name__} {value!r}")
        else:
            lines.append(f"{where}.{field}: {e['msg']}")
    return "\n".join(lines)


def _from_stanza(mode: str, stanza: Mapping, where: str) -> AccelerationConfig:
    errors = _unknown_keys(stanza, _SWITCHES, where)
    if errors:
        raise ValueError("\n".join(errors))
    try:
        return AccelerationConfig.model_validate({"mode": mode, **stanza})
    except ValidationError as err:
        raise ValueError(_validation_message(err, where)) from None


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _find_stanzas(data: Mapping) -> dict[str, Any]:
    """Walk the YAML tree; return {stanza path: stanza mapping}. Collects every structural error first."""
    errors: list[str] = []
    found: dict[str, Any] = {}

    def walk(node: Mapping, tree: dict[str, Any], prefix: str) -> None:
        errors.extend(_unknown_keys(node, list(tree), prefix))
        for key, sub in tree.items():
            if key not in node:
                continue
            path = f"{prefix}.{key}" if prefix else key
            value = node[key]
            if sub is None:  # a stanza: an empty one (`fused_ops_and_kernels:`) means all switches off
                if value is None:
                    value = {}
                if not isinstance(value, Mapping):
                    errors.append(f"{path} must be a mapping of switches, got {_type_name(value)} {value!r}")
                    continue
                errors.extend(_unknown_keys(value, _SWITCHES, path))
                found[path] = value
            elif isinstance(value, Mapping):
                walk(value, sub, path)
            else:
                errors.append(
                    f"{path} must be a mapping containing {' or '.join(repr(k) for k in sub)}, "
                    f"got {_type_name(value)} {value!r}"
                )

    walk(data, _TREE, "")
    if errors:
        raise ValueError("\n".join(errors))
    return found


def _from_mapping(data: Mapping, origin: str) -> AccelerationConfig:
    found = _find_stanzas(data)
    if len(found) == 2:
        raise ValueError(
            f"both {FULL_STANZA} and {PEFT_STANZA} are present in {origin}; exactly one must be used: "
            f"{FULL_STANZA} for full fine-tuning, {PEFT_STANZA} for LoRA/QLoRA (PEFT). Remove the other one"
        )
    if not found:
        raise ValueError(
            f"no foak stanza in {origin}; it needs exactly one of {FULL_STANZA} (full fine-tuning) or "
            f"{PEFT_STANZA} (LoRA/QLoRA)"
        )
    ((path, stanza),) = found.items()
    mode = "full" if path == FULL_STANZA else "peft"
    return _from_stanza(mode, stanza, path)


def load_config(source: str | os.PathLike | Mapping | AccelerationConfig) -> AccelerationConfig:
    """Build an :class:`AccelerationConfig` from a YAML file path, a parsed-YAML dict, or a config.

    A ``str`` is always a path, never YAML text: parse YAML text with ``yaml.safe_load`` and pass the dict.
    """
    if isinstance(source, AccelerationConfig):
        return source
    if isinstance(source, Mapping):
        return _from_mapping(source, "the config dict")
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            "load_config takes a path to a YAML file, a dict (parsed YAML) or an AccelerationConfig, "
            f"got {type(source).__name__}; for keyword switches use config_from_kwargs(...)"
        )
    path = Path(source)
    if not path.is_file():
        reason = "is a directory, not a config file" if path.is_dir() else None
        message = f"no such config file: {str(source)!r}" if reason is None else f"{str(source)!r} {reason}"
        if isinstance(source, str) and ("\n" in source or ":" in source):
            message += " (load_config does not accept YAML text; pass a file path, or yaml.safe_load(text) as a dict)"
        raise ConfigFileNotFoundError(message)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"config file {str(path)!r} is not valid YAML: {err}") from None
    if data is None:
        raise ValueError(
            f"config file {str(path)!r} is empty; it needs exactly one of the stanzas {FULL_STANZA} "
            f"(full fine-tuning) or {PEFT_STANZA} (LoRA/QLoRA)"
        )
    if isinstance(data, Mapping):
        return _from_mapping(data, f"config file {str(path)!r}")
    raise ValueError(
        f"config file {str(path)!r} must hold a mapping with {FULL_STANZA} or {PEFT_STANZA}, got {_type_name(data)}"
    )


def config_from_kwargs(mode: str = "full", **switches: Any) -> AccelerationConfig:
    """The config that a ``training`` stanza with these switches gives (a ``peft`` one with ``mode="peft"``).

    ``config_from_kwargs(fast_rms_layernorm=True, fused_linear_loss=True)``
    """
    if mode not in STANZA_OF_MODE:
        raise ValueError(
            f"mode must be 'full' (the {FULL_STANZA} stanza) or 'peft' (the {PEFT_STANZA} stanza), got {mode!r}"
        )
    return _from_stanza(mode, switches, STANZA_OF_MODE[mode])


_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # torch.<name>; torch imported on use
_MIXED_PRECISION = ("no", "fp16", "bf16")


def check_precision(weights_dtype: torch.dtype, mixed_precision: Literal["no", "fp16", "bf16"], peft: bool) -> None:
    """Raise ``ValueError`` if the weights' dtype and the trainer's mixed precision do not work together.

    ``weights_dtype`` is the dtype the model was loaded in (``torch_dtype``; for a quantized base, the
    dtype of its non-quantized weights). ``mixed_precision`` is accelerate's / the Trainer's setting
    (``fp16=True`` -> "fp16", ``bf16=True`` -> "bf16", neither -> "no"). ``peft`` is True for LoRA/QLoRA.

    Mixed-precision compatibility matrix:

    ====================== ======== ======== ========
    weights \\ mixed prec.  "no"     "fp16"   "bf16"
    ====================== ======== ======== ========
    fp32, full or PEFT     ok       ok       ok
    bf16, full or PEFT     ok       error    ok
    fp16, full fine-tuning error    error    error
    fp16, PEFT             error    ok       error
    ====================== ======== ======== ========

    - bf16 weights + fp16: fp16 autocast and its GradScaler on bf16 weights squeeze bf16's range into fp16
      (overflow above 65504). Use bf16 mixed precision or none.
    - fp16 weights, full fine-tuning: the fp16 GradScaler cannot unscale fp16 parameter gradients
      ("Attempting to unscale FP16 gradients"), and without a scaler fp16 gradients and updates underflow.
      Load the model in fp32 or bf16.
    - fp16 weights, PEFT: the frozen fp16 base needs fp16 mixed precision (the GradScaler keeps small
      gradients from underflowing; the trainable adapters are fp32). bf16 autocast over fp16 weights
      mixes two 16-bit formats; no mixed precision runs fp16 without loss scaling.
    """
    import torch  # here, not at the top: reading and validating a config needs no torch (foak train's early checks)

    if not isinstance(weights_dtype, torch.dtype) or str(weights_dtype).removeprefix("torch.") not in _DTYPE_NAMES:
        raise ValueError(
            f"weights_dtype must be torch.float32, torch.bfloat16 or torch.float16 (the dtype the model was loaded "
            f"in; for a quantized base, that of its non-quantized weights), got {weights_dtype!r}"
        )
    if mixed_precision not in _MIXED_PRECISION:
        raise ValueError(f"mixed_precision must be one of {_MIXED_PRECISION}, got {mixed_precision!r}")
    if not isinstance(peft, bool):
        raise TypeError(f"peft must be True (LoRA/QLoRA) or False (full fine-tuning), got {peft!r}")

    if weights_dtype == torch.float32:
        return
    if weights_dtype == torch.bfloat16:
        if mixed_precision == "fp16":
            raise ValueError(
                "bf16 weights with mixed_precision='fp16': fp16 autocast + GradScaler on bf16 weights runs the "
                "matmuls in fp16, whose range (max 65504) is far smaller than bf16's, so activations overflow. "
                f"Use mixed_precision='bf16' (or 'no'), or load the model in fp32 {_PRECISION_HINT}"
            )
        return
    # fp16 weights
    if not peft:
        raise ValueError(
            f"fp16 weights with full fine-tuning (mixed_precision={mixed_precision!r}): the fp16 GradScaler "
            "cannot unscale fp16 parameter gradients (torch raises 'ValueError: Attempting to unscale FP16 "
            "gradients.'), and without it fp16 gradients and optimizer updates underflow. Load the model in "
            "fp32 (torch_dtype=torch.float32, then mixed_precision='fp16' or 'bf16') or in bf16 "
            f"(torch_dtype=torch.bfloat16, mixed_precision='bf16' or 'no') {_PRECISION_HINT}"
        )
    if mixed_precision != "fp16":
        why = (
            "bf16 autocast over fp16 weights mixes two 16-bit formats (bf16 activations against fp16 weights)"
            if mixed_precision == "bf16"
            else "without mixed precision the fp16 model trains without loss scaling and small gradients "
            "underflow to zero"
        )
        raise ValueError(
            f"fp16 base weights with PEFT need mixed_precision='fp16', got {mixed_precision!r}: {why}. "
            "Use mixed_precision='fp16', or load the model in bf16 (with mixed_precision='bf16') "
            f"{_PRECISION_HINT}"
        )
