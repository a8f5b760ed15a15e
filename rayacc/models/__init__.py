"""Model registry: `mlp`, `gpt`, and user factories "package.module:function"."""

from rayacc.models.registry import ModelError, build_model, loss_functions

__all__ = ["ModelError", "build_model", "loss_functions"]
