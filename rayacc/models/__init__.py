"""Model registry: `mlp`, `gpt`, and user factories "package.module:function"."""

from rayacc.models.errors import ModelError
from rayacc.models.registry import (
    build_model,
    build_on_meta,
    loss_functions,
    supports_chunked_loss,
    unwrap_model,
)

__all__ = [
    "ModelError",
    "build_model",
    "build_on_meta",
    "loss_functions",
    "supports_chunked_loss",
    "unwrap_model",
]
