"""The models' one error (beneath the registry and the model kinds it builds)."""

from __future__ import annotations

__all__ = ["ModelError"]


class ModelError(ValueError):
    """A model that cannot be built from the config: names the field and the fix."""
