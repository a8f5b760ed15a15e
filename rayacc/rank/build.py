"""A run's model as the strategy of its config builds it: the recipe (how the user's module is
made), the strategy (`train.strategy`) that builds, wraps and steps it (engine/parallel/), and
`build_rank`, the one assembly of a rank's training parts that the worker, the planner's
calibration, `verify`, the combination matrix and the benches share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rayacc.config import TrainConfig
from rayacc.config.batch_split import BatchSplit
from rayacc.data.sources import DatasetInfo
from rayacc.engine.parallel import ModelRecipe, Strategy, strategy_class
from rayacc.engine.step import AccumulationStep
from rayacc.models.init import initial_values, seeds_parameters
from rayacc.models.registry import build_model, build_on_meta, loss_functions
from rayacc.optim import build_optimizer

__all__ = ["RankParts", "build_rank", "model_recipe", "strategy_for"]


@dataclass
class RankParts:
    """A rank's training parts, in the order they are built."""

    strategy: Strategy
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable
    """Per-item losses of a batch (engine/losses.py)."""
    count: Callable
    """The batch's count of loss items (rows or target tokens)."""
    accumulate: AccumulationStep
    """One optimizer step over a window's micro-batches (engine/step.py)."""


def build_rank(
    cfg: TrainConfig,
    info: DatasetInfo,
    device: torch.device,
    lr: float,
    *,
    oom_retry: bool = False,
    split: BatchSplit | None = None,
    strategy_user: dict[str, Any] | None = None,
    node: str | None = None,
) -> RankParts:
    """Strategy → model → optimizer → losses → accumulation step of `cfg` on `device`, at peak
    LR `lr` (the caller lays out a schedule, where it has one, over `parts.optimizer`).
    `oom_retry`: a CUDA out-of-memory error halves the micro-batch on all ranks, where the
    strategy can retry in place (`Contract.retries_out_of_memory`). `split`: the group's batch
    split (by default the config's at the group's size); `strategy_user`: the strategy's own
    file as the driver read it (by default read here: DeepSpeed's `deepspeed.config`); `node`:
    this rank's node (HSDP's `fsdp.replicate: auto` lays its mesh by the group's nodes)."""
    strategy = strategy_for(cfg, split, strategy_user, node)
    model = strategy.build(model_recipe(cfg, info), device)
    # a frozen base (adapters) has no optimizer state
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(cfg.optim, trainable, lr, device, strategy)
    model, optimizer = strategy.bind_optimizer(optimizer)
    # the window's count before its first backward: an engine that owns backward, fp16's scale
    first = strategy.contract.window_rule == "count_first" or cfg.train.precision == "fp16"
    loss_fn, count = loss_functions(
        info, cfg.train.loss_chunk_tokens, strategy, cfg.train.loss, counts_first=first
    )
    accumulate = AccumulationStep(
        model,
        optimizer,
        precision=cfg.train.precision,
        max_grad_norm=cfg.optim.max_grad_norm,
        oom_retry=oom_retry and strategy.contract.retries_out_of_memory,
        strategy=strategy,
    )
    return RankParts(strategy, model, optimizer, loss_fn, count, accumulate)


def strategy_for(
    cfg: TrainConfig,
    split: BatchSplit | None = None,
    user: Any = None,
    node: str | None = None,
) -> Strategy:
    """The strategy `train.strategy` names (its wing, through the registry), with its
    section's options."""
    return strategy_class(cfg.train.strategy).from_config(cfg, split, user, node)


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
        tokens=info.max_tokens - 1 if info.max_tokens > 1 else None,
    )
