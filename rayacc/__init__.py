"""rayacc: data-parallel PyTorch training with gradient accumulation on Ray clusters."""

from typing import Any

from rayacc.config import ConfigError, TrainConfig

__all__ = [
    "ConfigError",
    "FitResult",
    "ProgressPrinter",
    "TrainConfig",
    "build_model",
    "fit",
    "load_model",
]
__version__ = "0.1.0"

# loaded on first use: `import rayacc.engine` must not pull in ray or mlflow
_LAZY = {
    "fit": "rayacc.driver.fit",
    "FitResult": "rayacc.driver.fit",
    "build_model": "rayacc.models",
    "load_model": "rayacc.checkpoint.reader",
    "ProgressPrinter": "rayacc.observe.console",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rayacc' has no attribute {name!r}")
