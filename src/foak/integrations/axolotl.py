"""foak as an axolotl plugin: one line in the axolotl YAML, foak's switches under a key of their own.

```yaml
plugins:
  - foak.integrations.axolotl.FoakPlugin
foak:                        # optional: without it, every kernel foak has for the model (foak.patch's defaults)
  fused_linear_loss: false   # a switch given here overrides its default; the others keep theirs
```

What the plugin does, hook by hook (axolotl.integrations.base.BasePlugin):

- ``register`` (before axolotl validates the config): turns off axolotl's own fused LoRA kernels
  (``lora_mlp_kernel``, ``lora_qkv_kernel``, ``lora_o_kernel``) where the YAML leaves them unset and a foak kernel
  that is on collides with them (axolotl would switch them on for LoRA/QLoRA; foak's ``fused_lora`` serves the
  same layers, its ``fast_swiglu`` the MLP, and its RoPE would not run inside axolotl's rewritten attention
  forward); with ``foak: {fused_lora: false}`` the others stay axolotl's. The log says which and why.
- config validation (:class:`FoakArgs`, merged into axolotl's schema): the ``foak`` key is checked by foak's
  config schema (foak.config: unknown keys name the closest valid one, wrong types the expected one); the
  mode (full fine-tuning or LoRA/QLoRA) comes from axolotl's ``adapter``. Then every axolotl option that
  replaces the same modules as a foak kernel that is on is refused with one line that says which two collide
  and what to change (Liger's switches, the cut-cross-entropy plugin, axolotl's own LoRA kernels set to
  true, chunked cross-entropy, its tiled MLP, activation offloading next to foak's, HF hub kernels, MoE
  kernels), and so are set-ups foak is not tested in (DeepSpeed, tensor/context parallelism, RL trainers,
  fp8, adapters other than lora/qlora, foak's fused NF4 LoRA under FSDP2).
- ``pre_model_load``: refuses a model type foak has no rules for, and a weight dtype / mixed precision pair
  that foak.config.check_precision rejects, before the weights are read.
- ``post_model_load`` (the model with its adapters, before the trainer wraps it in FSDP2): ``foak.patch``
  with the resolved switches; the main process prints the patch report; :attr:`FoakPlugin.report` keeps it.

Installed foak (``pip install``, also ``-e``) declares the plugin in axolotl's ``axolotl.plugins`` entry-point
group (pyproject.toml), which axolotl loads in every run, listed or not: each hook above acts only for a config
whose ``plugins:`` names it, and :class:`FoakArgs` refuses a ``foak:`` key in a config that does not, with one
line that says what to add. (axolotl's own schema ignores unknown keys: without that, such a config trains
without foak and says nothing; so does it where foak is importable from PYTHONPATH but not installed.)

Sample packing needs nothing more: with ``sample_packing: true`` and ``sdpa``/``eager`` attention axolotl
drops the attention mask and passes position ids that restart per sequence, which is the packed batch
foak's ``fast_packed_attention`` serves (flash-attention models already attend per sequence; that row says
so). FSDP2 (``fsdp_version: 2``): the model is patched before accelerate shards it; foak's rules read a
module's parameters only inside its forward, where FSDP2 has gathered them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from axolotl.integrations.base import BasePlugin
from pydantic import BaseModel, model_validator

__all__ = ["FoakArgs", "FoakPlugin", "PLUGIN_NAME", "resolve_config"]

PLUGIN_NAME = "foak.integrations.axolotl.FoakPlugin"
KEY = "foak"
LOG = logging.getLogger(__name__)

_LOSS = ("fused_linear_loss", "fast_loss")
_OWN_ROPE = (" (axolotl's rewritten attention forward calls its own copy of apply_rotary_pos_emb: foak's RoPE "
             "would not run)")
# axolotl option -> (foak switches that do the same job (each on unless `foak:` sets it false), what it replaces)
_OVERLAPS: dict[str, tuple[tuple[str, ...], str]] = {
    # (axolotl rewrites the attention forward for either key and runs it with a COPY of the modeling module's
    # globals taken before foak patches: its apply_rotary_pos_emb is the original, foak's RoPE never runs there)
    "lora_qkv_kernel": (("fused_lora", "fast_rope_embeddings"), "the LoRA q/k/v projections" + _OWN_ROPE),
    "lora_o_kernel": (("fused_lora", "fast_rope_embeddings"), "the LoRA output projection" + _OWN_ROPE),
    "lora_mlp_kernel": (("fused_lora", "fast_swiglu"), "the LoRA MLP (gate/up/down and its activation)"),
    "liger_rms_norm": (("fast_rms_layernorm",), "the RMSNorm"),
    "liger_rms_norm_gated": (("fast_rms_layernorm",), "the gated RMSNorm (Qwen3.5's linear-attention layers)"),
    # (Qwen3 / Qwen3.5 / Gemma 4 / GLM-4.7-Flash: one Triton launch for q_norm/k_norm and RoPE in the attention)
    "fused_attn_kernel": (("fast_rms_layernorm", "fast_rope_embeddings"), "the q/k norms and the rotary embedding"),
    "liger_rope": (("fast_rope_embeddings",), "the rotary embedding"),
    "liger_glu_activation": (("fast_swiglu",), "the gated MLP"),
    "liger_swiglu": (("fast_swiglu",), "the gated MLP"),
    "liger_cross_entropy": (_LOSS, "the loss"),
    "liger_fused_linear_cross_entropy": (_LOSS, "the LM head and the loss"),
    "cut_cross_entropy": (_LOSS, "the LM head and the loss"),
    "chunked_cross_entropy": (_LOSS, "the loss"),
    "flash_attn_cross_entropy": (_LOSS, "the loss"),
    "flash_attn_fuse_mlp": (("fast_swiglu",), "the gated MLP"),
    "tiled_mlp": (("fast_swiglu", "tiled_mlp"), "the MLP's forward"),
    "use_kernels": (("fast_rms_layernorm", "fast_swiglu"), "the RMSNorm and the MLP activation (hub kernels)"),
    "use_scattermoe": (("fast_moe",), "the MoE experts"),
    "use_sonicmoe": (("fast_moe",), "the MoE experts"),
    "expert_backend": (("fast_moe",), "the MoE experts"),
}
# axolotl's fused LoRA kernels that it switches on by itself when the YAML leaves them unset
_AXOLOTL_LORA_KERNELS = ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel")
_OFF_BY_DEFAULT = {"offload_activations", "tiled_mlp"}  # opt-in in foak (not in foak.patch's defaults)


def _mode(adapter: Any) -> str:
    return "peft" if adapter in ("lora", "qlora") else "full"


def _switches(value: Any) -> dict[str, Any]:
    """The user's ``foak:`` mapping, checked by foak's schema (with the axolotl-side key names)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{KEY}: must be a mapping of foak switches (e.g. `{KEY}: {{fused_linear_loss: true}}`), "
                         f"or left out for foak's defaults; got {type(value).__name__} {value!r}")
    return {str(k): v for k, v in value.items()}


def _check_switches(switches: dict[str, Any], adapter: Any) -> None:
    from foak.config import FULL_STANZA, PEFT_STANZA, config_from_kwargs

    mode = _mode(adapter)
    if "mode" in switches:
        raise ValueError(f"{KEY}.mode: not a setting here; foak's mode follows axolotl's `adapter` (lora/qlora: "
                         "LoRA kernels, none: full fine-tuning); remove it")
    if mode == "full":  # (foak's own message would point at the acceleration YAML's peft stanza)
        for key in ("fused_lora", "base_layer"):
            if switches.get(key, False) not in (False, "none") and (key == "base_layer" or switches[key] is True):
                raise ValueError(f"{KEY}.{key}: {switches[key]!r} needs `adapter: lora` or `adapter: qlora` (this "
                                 "config fine-tunes the full model); remove it")
    try:
        config_from_kwargs(mode, **switches)
    except ValueError as err:  # foak's message, with the axolotl key in place of the acceleration YAML's stanza
        raise ValueError(str(err).replace(PEFT_STANZA, KEY).replace(FULL_STANZA, KEY)) from None


def _on(switches: Mapping[str, Any], name: str, peft: bool = True) -> bool:
    """Whether a foak switch may be on: set true, or left to foak's default (every kernel but the opt-in ones;
    fused_lora only with LoRA/QLoRA)."""
    if name in switches:
        return bool(switches[name])
    return name not in _OFF_BY_DEFAULT and (peft or name != "fused_lora")


def _refusals(get, switches: Mapping[str, Any]) -> list[str]:
    """One line per axolotl setting the plugin cannot run with; ``get`` reads the (validated) axolotl config."""
    lines = []
    peft = _mode(get("adapter")) == "peft"
    for option, (foak_switches, what) in _OVERLAPS.items():
        value = get(option)
        if not value or (option == "expert_backend" and value not in ("scattermoe", "sonicmoe")):
            continue
        on = [s for s in foak_switches if _on(switches, s, peft)]
        if option == "tiled_mlp" and on:
            lines.append(f"axolotl's tiled_mlp and foak's {' and '.join(on)} both replace {what}: use foak's "
                         f"tiled MLP instead (`{KEY}: {{tiled_mlp: true}}`, the fused GLU in sequence chunks, and "
                         "remove tiled_mlp), or set them false under `foak:`")
        elif on:
            settings = ", ".join(f"{s}: false" for s in on)
            lines.append(f"{option}: {value!r} and foak's {' / '.join(on)} both replace {what}; remove {option} "
                         f"(or set it false), or turn foak's off with `{KEY}: {{{settings}}}`")
    offload = get("activation_offloading") or get("gradient_checkpointing") in ("offload", "offload_disk")
    if offload and _on(switches, "offload_activations"):
        lines.append(f"axolotl's activation offloading and foak's offload_activations both move the checkpointed "
                     f"activations to the CPU; keep one (remove activation_offloading / gradient_checkpointing: "
                     f"offload, or `{KEY}: {{offload_activations: false}}`)")
    if get("deepspeed"):
        lines.append("deepspeed: foak is not tested under DeepSpeed; use axolotl's FSDP2 (fsdp_version: 2) or a "
                     "single process, or remove the foak plugin")
    for option in ("tensor_parallel_size", "context_parallel_size", "sequence_parallel_degree"):
        if (get(option) or 1) > 1:
            lines.append(f"{option}: {get(option)}: foak is not tested with tensor, context or sequence "
                         "parallelism (its kernels see whole sequences and weights); remove it or the foak plugin")
    if get("rl"):
        rl = getattr(get("rl"), "value", get("rl"))  # an enum after validation
        lines.append(f"rl: {rl}: foak's axolotl plugin serves supervised fine-tuning (causal LM loss), not axolotl's "
                     "RL trainers; remove the foak plugin for this run")
    if get("fp8"):
        lines.append("fp8: true: foak's kernels are not tested on fp8 (torchao Float8) linears; remove fp8 or the "
                     "foak plugin")
    adapter = get("adapter")
    if adapter not in (None, "lora", "qlora"):
        lines.append(f"adapter: {adapter!r}: foak serves full fine-tuning, lora and qlora; use one of them or remove "
                     "the foak plugin")
    fsdp = bool(get("fsdp_config") or get("fsdp"))  # what axolotl's loader takes as FSDP (fsdp_version defaults to 2)
    if adapter == "qlora" and fsdp and _on(switches, "fused_lora"):
        lines.append("adapter: qlora with FSDP2: axolotl stores the 4-bit weights as bf16 for FSDP to shard, and "
                     f"foak's fused NF4 LoRA is not tested on sharded 4-bit weights; set `{KEY}: {{fused_lora: "
                     "false}` (foak's other kernels still apply) or train without FSDP")
    return lines


class FoakArgs(BaseModel):
    """The ``foak:`` key of the axolotl config (merged into axolotl's config schema by its PluginManager)."""

    foak: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_foak_switches(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        if _named(data.get("plugins")):
            _check_switches(_switches(data.get(KEY)), data.get("adapter"))
        elif KEY in data:  # (axolotl loaded the plugin through foak's entry point; the config does not list it)
            raise ValueError(_not_listed(data.get("plugins")))
        return data

    @model_validator(mode="after")
    def _check_axolotl_options(self):
        if not _named(getattr(self, "plugins", None)):
            return self
        lines = _refusals(lambda name: getattr(self, name, None), _switches(self.foak))
        if lines:
            raise ValueError("foak: " + lines[0] + (f" (and {len(lines) - 1} more: {'; '.join(lines[1:])})"
                                                    if len(lines) > 1 else ""))
        return self


def _not_listed(plugins: Any) -> str:
    """The refusal of a ``foak:`` key in a config whose ``plugins:`` does not name the plugin (without it axolotl
    drops the key and trains without foak)."""
    listed = ", ".join([*(str(p) for p in plugins or ()), PLUGIN_NAME])
    return (f"{KEY}: this config has a `{KEY}:` key but does not list foak's plugin under `plugins:`, so foak would "
            f"not run: add `plugins: [{listed}]` (or remove the `{KEY}:` key)")


def _named(plugins: Any) -> bool:
    """Whether the config's ``plugins`` list names this plugin (axolotl keeps a registered plugin for the rest
    of the process: its hooks must not act on a later config that does not ask for foak)."""
    return any(str(p).replace(":", ".") == PLUGIN_NAME for p in plugins or ())


def resolve_config(model, switches: Mapping[str, Any] | None):
    """The AccelerationConfig foak patches ``model`` with: foak.patch's defaults for it
    (foak.api.default_config), each switch in ``switches`` overriding its default. Setting one of
    fused_linear_loss / fast_loss true turns the other off (they exclude each other)."""
    from foak.api import default_config

    given = dict(switches or {})
    for one, other in (_LOSS, _LOSS[::-1]):
        if given.get(one) and other not in given:
            given[other] = False
    return default_config(model, **given)


def _collisions(keys: list[str], switches: Mapping[str, Any]) -> str:
    """The log line's account of the axolotl LoRA kernels the plugin set false: which foak switch each collides
    with (and that PEFT's own forwards run the LoRA layers where foak's fused_lora is off)."""
    if not keys:
        return ""
    parts = [f"{k} (foak's {' / '.join(s for s in _OVERLAPS[k][0] if _on(switches, s))} on)" for k in keys]
    text = f"; set to false: {', '.join(parts)}"
    if not _on(switches, "fused_lora"):
        text += (": those LoRA layers run PEFT's own forward; turn the foak switches named off under `foak:` to "
                 "keep axolotl's LoRA kernels")
    return text


def _axolotl_would_enable_lora_kernels(cfg) -> bool:
    """Whether axolotl would switch its lora_*_kernel keys on for this (raw) config (its own predicate)."""
    from axolotl.utils.schemas.validation import lora_kernels_auto_enable

    return lora_kernels_auto_enable(cfg.get)


def _mixed_precision(cfg) -> str:
    return "bf16" if cfg.bf16 is True else "fp16" if cfg.fp16 else "no"


class FoakPlugin(BasePlugin):
    """``plugins: [foak.integrations.axolotl.FoakPlugin]``: patches the model axolotl loads with foak."""

    def __init__(self):
        super().__init__()
        self.report = None
        self.turned_off: list[str] = []

    def get_input_args(self) -> str:
        return "foak.integrations.axolotl.FoakArgs"

    def register(self, cfg):
        if not _named(cfg.get("plugins")):
            return
        # axolotl switches its fused LoRA kernels on when all its lora_*_kernel keys are unset (LoRA/QLoRA); those
        # that collide with a foak kernel that is on (_OVERLAPS) are set false first, so that nothing runs twice
        if cfg.get("adapter") not in ("lora", "qlora") or any(cfg.get(k) is not None for k in _AXOLOTL_LORA_KERNELS):
            return
        try:
            switches = _switches(cfg.get(KEY))
        except ValueError:  # (reported by the config validation that follows)
            switches = {}
        colliding = [k for k in _AXOLOTL_LORA_KERNELS if any(_on(switches, s) for s in _OVERLAPS[k][0])]
        if len(colliding) < len(_AXOLOTL_LORA_KERNELS) and _axolotl_would_enable_lora_kernels(cfg):
            # `foak: {fused_lora: false}`: foak leaves (some of) these layers to PEFT. Setting one key ends axolotl's
            # all-or-nothing switch-on, so the others are switched on here as axolotl would have done (before: all
            # three were turned off and the log said foak served them: no fused LoRA at all)
            for key in (*_AXOLOTL_LORA_KERNELS, "lora_embedding_kernel"):
                if cfg.get(key) is None:
                    cfg[key] = key not in colliding
            self.turned_off = colliding
            LOG.warning("foak: axolotl's own LoRA kernels serve %s (foak's fused_lora is off)%s",
                        ", ".join(k for k in _AXOLOTL_LORA_KERNELS if k not in colliding),
                        _collisions(colliding, switches))
            return
        for key in colliding:
            cfg[key] = False
        self.turned_off = colliding
        if colliding:
            LOG.warning("foak: axolotl's LoRA kernels (which it switches on when they are unset)%s",
                        _collisions(colliding, switches))

    def pre_model_load(self, cfg):
        if not _named(cfg.plugins):
            return
        from foak.config import check_precision
        from foak.models import ARCHITECTURES, served_model_type

        model_type = served_model_type(cfg.model_config_type)
        if model_type not in ARCHITECTURES:
            raise ValueError(f"foak has no rules for model_type {cfg.model_config_type!r} ({cfg.base_model}); "
                             f"served: {', '.join(sorted(ARCHITECTURES))}. Remove the foak plugin for this model")
        import torch

        dtype = cfg.torch_dtype if isinstance(cfg.torch_dtype, torch.dtype) else torch.float32
        try:
            check_precision(dtype, _mixed_precision(cfg), peft=_mode(cfg.adapter) == "peft")
        except ValueError as err:
            raise ValueError(f"foak: {err}") from None

    def post_model_load(self, cfg, model):
        if not _named(cfg.plugins):
            return
        import foak
        from foak.integrations.accelerate import is_main_process

        config = resolve_config(model, _switches(cfg.get(KEY)))
        self.report = foak.patch(model, config, mixed_precision=_mixed_precision(cfg))
        if is_main_process():  # printed (as FoakCallback does): axolotl's log setup shows only its own loggers
            print(self.report, flush=True)
