"""A run's model as the strategy of its config builds it: the recipe (how the user's module is
made) and the strategy (`train.strategy`) that builds, wraps and steps it (engine/strategy.py)."""

from __future__ import annotations

import torch

from rayacc.config import TrainConfig
from rayacc.data.sources import DatasetInfo
from rayacc.engine.strategy import DDP, FSDP, ModelRecipe, Strategy
from rayacc.models.init import initial_values, seeds_parameters
from rayacc.models.registry import build_model, build_on_meta

__all__ = ["model_recipe", "strategy_for"]


def strategy_for(cfg: TrainConfig) -> Strategy:
    """The strategy `train.strategy` names, with its section's options."""
    if cfg.train.strategy == "fsdp":
        bf16 = cfg.train.precision == "bf16" and cfg.fsdp.mixed_precision
        return FSDP(
            cfg.fsdp.grad_sync,
            reshard_after_forward=cfg.fsdp.reshard_after_forward,
            param_dtype=torch.bfloat16 if bf16 else None,
        )
    return DDP()


def model_recipe(cfg: TrainConfig, info: DatasetInfo) -> ModelRecipe:
    """How the config's module is made: whole from the seed, or on the meta device with each
    parameter's initial value drawn from (seed, name) when the module says how it starts."""
    setting = cfg.train.activation_checkpointing
    every_n = None if setting == "none" else 1 if setting == "full" else setting.every_n

    def values(module):
        return initial_values(module, cfg.seed) if seeds_parameters(module) else None

    return ModelRecipe(
        build=lambda: build_model(cfg, info),
        build_on_meta=lambda: build_on_meta(cfg, info),
        initial_values=values,
        activation_checkpointing=every_n,
        compile=cfg.train.compile,
    )
