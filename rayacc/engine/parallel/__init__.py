"""The parallel strategy: everything that differs between replicating a model (DDP) and sharding
it (FSDP2), behind one interface, so that the accumulation step, the micro-batch search and the
worker never ask which one runs.

More: docs/design.md, "Notes from the code" (engine/parallel/__init__.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from rayacc.engine.parallel.base import CommStats, Contract, ModelRecipe, Strategy
from rayacc.engine.parallel.ddp import DDP
from rayacc.engine.parallel.deepspeed import DeepSpeed
from rayacc.engine.parallel.deepspeed_config import DeepSpeedConfigError, deepspeed_config
from rayacc.engine.parallel.fsdp import FSDP
from rayacc.engine.parallel.state import (
    SHARDS_DIR,
    ShardedState,
    StateFormat,
    WholeState,
    host_copy,
)
from rayacc.engine.units import is_fsdp, unwrap

__all__ = [
    "DDP",
    "FSDP",
    "SHARDS_DIR",
    "STRATEGIES",
    "CommStats",
    "Contract",
    "DeepSpeed",
    "DeepSpeedConfigError",
    "ModelRecipe",
    "ShardedState",
    "StateFormat",
    "Strategy",
    "WholeState",
    "deepspeed_config",
    "host_copy",
    "make_strategy",
    "strategy_of",
    "unwrap",
]

STRATEGIES: dict[str, type[Strategy]] = {"ddp": DDP, "fsdp": FSDP, "deepspeed": DeepSpeed}


def make_strategy(name: str, **options: Any) -> Strategy:
    """The strategy called `name` (`train.strategy`) with its options."""
    if name not in STRATEGIES:
        raise ValueError(f"strategy {name!r} is not one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name](**options)


def strategy_of(model: nn.Module, **options: Any) -> Strategy:
    """The strategy a model wrapped by the caller was wrapped for, bound to it."""
    if is_fsdp(model):
        return FSDP(**options).adopt(model)
    return DDP().adopt(model)
