"""Hooks into training frameworks (HF Trainer / TRL today)."""

from foak.integrations.trainer import FoakCallback

__all__ = ["FoakCallback"]
