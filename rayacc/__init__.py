"""rayacc: data-parallel PyTorch training with gradient accumulation on Ray clusters."""

from rayacc.config import ConfigError, TrainConfig

__all__ = ["ConfigError", "TrainConfig"]
__version__ = "0.1.0"
