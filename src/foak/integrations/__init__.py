"""Hooks into training frameworks: FoakCallback for HF Trainer / TRL scripts (integrations/trainer.py) and
TRL's fused LM head served by foak's loss (integrations/trl.py, registered with the fused_linear_loss rule when
foak.api is imported)."""


def __getattr__(name):
    # lazy: importing foak.api imports foak.integrations.trl, which must not pull in transformers' Trainer
    if name == "FoakCallback":
        from foak.integrations.trainer import FoakCallback

        return FoakCallback
    raise AttributeError(f"module 'foak.integrations' has no attribute {name!r}")


__all__ = ["FoakCallback"]
