"""foak as an fms-acceleration plugin: fms-hf-tuning's ``--acceleration_framework_config_file`` with the
``training.fused_ops_and_kernels`` / ``peft.quantization.fused_ops_and_kernels`` stanzas patches the model with
foak (docs/fms-acceleration.md).

Importing this module registers :class:`FoakAccelerationPlugin` with fms_acceleration for both stanzas (either
one activates it). fms_acceleration finds plugins only by importing the packages ``fms_acceleration_peft``,
``fms_acceleration_foak``, ``fms_acceleration_aadp``, ``fms_acceleration_moe`` and ``fms_acceleration_odm``
when it is imported; foak is none of them, so something must import this module before
``AccelerationFramework(...)`` is built: your script (``import foak.integrations.fms_acceleration``), or this
module as the launcher of an unchanged training module::

    python -m foak.integrations.fms_acceleration tuning.sft_trainer --acceleration_framework_config_file foak.yaml ...
    accelerate launch -m foak.integrations.fms_acceleration tuning.sft_trainer ...

The stanza takes foak's switches (foak.config) and the values of fms-acceleration-foak's YAML, translated:
``fast_loss: fused_ce_liger`` is foak's ``fused_linear_loss: true``; ``base_layer: auto_gptq`` is foak's
``base_layer: gptq``; ``base_layer: null`` is unset; the ``fast_rsm_layernorm`` spelling of fms-acceleration's
sample configs and fms-hf-tuning's FastKernelsConfig is ``fast_rms_layernorm``. Each translation is printed with
the patch report. Any other key or value is a ValueError when the framework is built.

The flow fms-hf-tuning runs: ``AccelerationFramework(path)`` (the stanza is validated), ``augmentation(model,
train_args, modifiable_args)`` (the architecture and the weight dtype against ``--bf16``/``--fp16`` are checked;
nothing changes), then, once the trainer holds the model (and its LoRA layers),
``get_callbacks_and_ready_for_train(model, accelerator)`` runs ``foak.patch`` and prints the report.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Mapping
from typing import Any

try:
    from fms_acceleration import AccelerationPlugin, AccelerationPluginConfigError
    from fms_acceleration.framework_plugin import PLUGIN_REGISTRATIONS
except ImportError as err:  # (one line, before anything else fails)
    raise ImportError(
        f"foak.integrations.fms_acceleration needs the fms-acceleration package ({err}); fms-hf-tuning installs it "
        "with its [fms-accel] extra, or: pip install --no-deps fms-acceleration==0.6.4"
    ) from None

from foak.config import FULL_STANZA, PEFT_STANZA, AccelerationConfig, load_config

__all__ = ["STANZAS", "FoakAccelerationPlugin", "FoakPluginConfigError", "config_from_plugin_configurations",
           "main", "register"]

STANZAS = (FULL_STANZA, PEFT_STANZA)

# fms-acceleration-foak's values, as foak spells them
_SEED_LOSS = "fused_ce_liger"  # its fused linear cross-entropy (LM head + loss): foak's fused_linear_loss
_SEED_BASE_LAYERS = {"auto_gptq": "gptq", "bitsandbytes": "bitsandbytes"}
_SEED_RMS_SPELLING = "fast_rsm_layernorm"


class FoakPluginConfigError(AccelerationPluginConfigError, ValueError):
    """A stanza foak cannot honour. A ValueError too (fms-hf-tuning reports those as user errors)."""


# ---- the stanza: fms-acceleration-foak's values -> foak's switches ----------------------------------------


def _translate(stanza: Mapping, where: str) -> tuple[dict[str, Any], list[str]]:
    """foak's switches for one stanza, and a line per value read in fms-acceleration-foak's spelling."""
    out = dict(stanza)
    notes: list[str] = []
    errors: list[str] = []

    if _SEED_RMS_SPELLING in out:
        value = out.pop(_SEED_RMS_SPELLING)
        if "fast_rms_layernorm" in out and out["fast_rms_layernorm"] != value:
            errors.append(f"{where}: {_SEED_RMS_SPELLING}: {value!r} and fast_rms_layernorm: "
                          f"{out['fast_rms_layernorm']!r} disagree (the first is a misspelling of the second); keep "
                          "fast_rms_layernorm")
        else:
            out["fast_rms_layernorm"] = value
            notes.append(f"{where}.{_SEED_RMS_SPELLING} read as fast_rms_layernorm: {value!r} (the spelling of "
                         "fms-acceleration's sample configs and fms-hf-tuning's FastKernelsConfig)")

    loss = out.get("fast_loss")
    if isinstance(loss, str):
        if loss != _SEED_LOSS:
            errors.append(f"{where}.fast_loss: expected true, false or {_SEED_LOSS!r} (the fused linear "
                          f"cross-entropy), got {loss!r}")
        elif out.get("fused_linear_loss", True) is not True:
            errors.append(f"{where}: fast_loss: {_SEED_LOSS} asks for the fused linear loss and fused_linear_loss: "
                          f"{out['fused_linear_loss']!r} refuses it; remove one of the two")
        else:
            out["fast_loss"] = False
            out["fused_linear_loss"] = True
            notes.append(f"{where}.fast_loss: {_SEED_LOSS} read as fused_linear_loss: true (foak's LM head + "
                         "cross-entropy that never materialises the logits)")

    if "base_layer" in out:
        base = out["base_layer"]
        if base is None:  # (fms-hf-tuning's FusedLoraConfig writes base_layer: null when it is not given)
            del out["base_layer"]
        elif isinstance(base, str) and base in _SEED_BASE_LAYERS:
            out["base_layer"] = _SEED_BASE_LAYERS[base]
            if base != out["base_layer"]:
                notes.append(f"{where}.base_layer: {base} read as base_layer: {out['base_layer']} (foak fuses LoRA "
                             "over its own GPTQLinear layers)")
        elif not (isinstance(base, str) and base in ("none", "gptq")):
            errors.append(f"{where}.base_layer: expected auto_gptq or bitsandbytes (or foak's none, gptq), got "
                          f"{base!r}")
    if errors:
        raise FoakPluginConfigError("\n".join(errors))
    return out, notes


def config_from_plugin_configurations(configurations: Mapping) -> tuple[AccelerationConfig, list[str]]:
    """foak's AccelerationConfig from the part of the framework's YAML (under ``plugins:``) that fms_acceleration
    hands the plugin, and the translation notes. A :class:`FoakPluginConfigError` for anything foak cannot
    honour: unknown keys (naming the closest valid one), wrong values, both stanzas at once."""
    if not isinstance(configurations, Mapping):
        raise FoakPluginConfigError(f"foak's plugin expected the YAML mapping under 'plugins:', got "
                                    f"{type(configurations).__name__}")
    translated: dict[str, Any] = {}
    notes: list[str] = []
    for path in STANZAS:
        node: Any = configurations
        for key in path.split("."):
            node = node.get(key) if isinstance(node, Mapping) else None
        if node is None:
            continue
        if isinstance(node, Mapping):
            node, stanza_notes = _translate(node, path)
            notes += stanza_notes
        target = translated
        *parents, leaf = path.split(".")
        for key in parents:
            target = target.setdefault(key, {})
        target[leaf] = node
    try:
        return load_config(translated), notes
    except ValueError as err:
        raise FoakPluginConfigError(str(err)) from None


# ---- the plugin ------------------------------------------------------------------------------------------


def _mixed_precision_of_args(train_args) -> str | None:
    if train_args is None:
        return None
    if getattr(train_args, "bf16", False):
        return "bf16"
    return "fp16" if getattr(train_args, "fp16", False) else "no"


class FoakAccelerationPlugin(AccelerationPlugin):
    """foak's kernels for fms-acceleration's ``fused_ops_and_kernels`` stanzas (the module docstring says how)."""

    # foak's own table of architectures decides (a clear ValueError in augmentation for one it does not know)
    restricted_model_archs = None
    require_packages = None

    def __init__(self, configurations: dict[str, dict]):
        super().__init__(configurations)
        _refuse_other_plugins()
        self.config, self.translations = config_from_plugin_configurations(configurations)
        if not self.config.enabled_rules():
            raise FoakPluginConfigError(f"{self.config.stanza_path} switches no kernel on; set at least one switch "
                                        "to true (or remove the stanza)")
        self.mixed_precision: str | None = None
        self.report = None

    @property
    def requires_augmentation(self) -> bool:
        return True

    def augmentation(self, model, train_args, modifiable_args):
        """Checks what can be checked before the trainer exists (architecture, weight dtype vs ``--bf16`` /
        ``--fp16``); the model and ``modifiable_args`` come back unchanged (foak patches in
        :meth:`get_callbacks_and_ready_for_train`, once LoRA layers added by the trainer are there)."""
        import torch

        from foak.config import check_precision
        from foak.models import rules_for

        rules_for(model)
        self.mixed_precision = _mixed_precision_of_args(train_args)
        if self.mixed_precision is not None:
            weights = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
            check_precision(weights, self.mixed_precision, peft=self.config.mode == "peft")
        return model, modifiable_args

    def get_callbacks_and_ready_for_train(self, model=None, accelerator=None):
        """``foak.patch`` on the model the trainer trains (or the model it wraps); prints the report on the
        main process. No callbacks."""
        import foak
        from foak.integrations.accelerate import is_main_process

        if model is None:
            raise ValueError("foak's fms-acceleration plugin: get_callbacks_and_ready_for_train got no model to "
                             "patch; pass the model the trainer trains")
        mixed_precision = self.mixed_precision
        if mixed_precision is None and accelerator is not None:
            mixed_precision = str(getattr(accelerator, "mixed_precision", "")) or None
            if mixed_precision not in ("no", "fp16", "bf16"):
                mixed_precision = None
        self._check_base_layer(model)
        self.report = foak.patch(model, self.config, mixed_precision=mixed_precision)
        main = accelerator.is_main_process if accelerator is not None else is_main_process()
        if main:
            for line in self.translations:
                print(f"foak (fms-acceleration plugin): {line}")
            print(self.report)
        return []

    def _check_base_layer(self, model) -> None:
        if self.config.base_layer != "gptq":
            return
        from foak.patching.lora_bases import GPTQ, format_of

        if any(format_of(m) is GPTQ for m in model.modules()):
            return
        quant_linears = sorted({type(m).__name__ for m in model.modules() if "QuantLinear" in type(m).__name__})
        found = f" (the model holds {', '.join(quant_linears)})" if quant_linears else ""
        raise FoakPluginConfigError(
            "base_layer: auto_gptq: foak fuses LoRA over its own GPTQLinear (foak.quant.load_gptq + "
            "foak.quant.gptq_peft.register_gptq_lora), not over auto_gptq/gptqmodel's QuantLinear that "
            f"fms-acceleration-peft's auto_gptq loader makes{found}; remove base_layer and fused_lora to run foak's "
            "other kernels on this model")


# ---- registration ----------------------------------------------------------------------------------------


def _ours(registration) -> bool:
    plugin = registration.plugin
    return getattr(plugin, "__module__", None) == __name__ and getattr(plugin, "__qualname__", None) == \
        FoakAccelerationPlugin.__qualname__


def _others_on_our_stanzas() -> list[str]:
    found = []
    for registration in PLUGIN_REGISTRATIONS:
        if _ours(registration):
            continue
        paths = set(registration.AND or []) | set(registration.OR or [])
        shared = sorted(paths & set(STANZAS))
        if shared:
            package = registration.package_name or getattr(registration.plugin, "__module__", "?")
            version = f" {registration.package_version}" if registration.package_version else ""
            found.append(f"{registration.plugin.__name__} of {package}{version} (registered for {', '.join(shared)})")
    return found


def _refuse_other_plugins() -> None:
    others = _others_on_our_stanzas()
    if others:
        raise FoakPluginConfigError(
            f"foak's fms-acceleration plugin and {'; '.join(others)} read the same stanzas, so both would patch the "
            "model (fms_acceleration imports fms_acceleration_foak on its own when it is installed); to use foak, "
            "pip uninstall fms-acceleration-foak")


def register() -> None:
    """Register :class:`FoakAccelerationPlugin` for both stanzas (done on import; again is a no-op)."""
    if any(_ours(r) for r in PLUGIN_REGISTRATIONS):
        return
    _refuse_other_plugins()
    AccelerationPlugin.register_plugin(FoakAccelerationPlugin, configuration_or_paths=list(STANZAS))
    # fms_acceleration names the plugin's package by its module's package (foak.integrations, not a distribution)
    registration = next(r for r in PLUGIN_REGISTRATIONS if _ours(r))
    registration.package_name = "foak"
    try:
        registration.package_version = importlib.metadata.version("foak")
    except importlib.metadata.PackageNotFoundError:  # a checkout on PYTHONPATH
        import foak

        registration.package_version = foak.__version__


def main(argv: list[str] | None = None) -> None:
    """``python -m foak.integrations.fms_acceleration MODULE [ARGS...]``: register foak's plugin, then run MODULE
    as ``python -m MODULE ARGS...`` would (e.g. ``tuning.sft_trainer`` of fms-hf-tuning)."""
    import runpy

    argv = list(sys.argv[1:] if argv is None else argv)
    usage = ("usage: python -m foak.integrations.fms_acceleration MODULE [ARGS...]\n"
             "Registers foak as the fms-acceleration plugin of the fused_ops_and_kernels stanzas, then runs MODULE "
             "as 'python -m MODULE ARGS...' would, e.g.\n  python -m foak.integrations.fms_acceleration "
             "tuning.sft_trainer --acceleration_framework_config_file foak.yaml ...")
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        raise SystemExit(0)
    if not argv or argv[0].startswith("-"):
        print(usage, file=sys.stderr)
        raise SystemExit(2)
    import foak.integrations.fms_acceleration  # noqa: F401  (this file under its own name: registers the plugin)

    module, *args = argv
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
else:
    register()
