"""Typed run configuration: YAML file + ``key.path=value`` overrides → :class:`TrainConfig`.

`schema` holds the sections, `overrides` the override parser, `errors` the one translator of
validation errors, `rules` the cross-field rules (one function per section), `sweep` the sweep
schema and `loader` the YAML loader. Every problem in a config is collected and reported at once
by :class:`ConfigError`, each line naming the field path, the value given and how to fix it.
"""

from rayacc.config.errors import ConfigError, ConfigIssue
from rayacc.config.schema import (
    BatchConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    ScalingConfig,
    TrackingConfig,
    TrainConfig,
    TrainSection,
)
from rayacc.config.sweep import RandomSearch, SweepConfig

__all__ = [
    "BatchConfig",
    "ConfigError",
    "ConfigIssue",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "RandomSearch",
    "RunConfig",
    "ScalingConfig",
    "SweepConfig",
    "TrackingConfig",
    "TrainConfig",
    "TrainSection",
]
