"""The parallel strategy: everything that differs between replicating a model (DDP) and sharding
it (FSDP2), behind one interface, so that the accumulation step, the micro-batch search and the
worker never ask which one runs.

More: docs/design.md, "Notes from the code" (engine/parallel/__init__.py).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from torch import nn

from rayacc.config.strategies import strategies, strategy_entry
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
    "CommStats",
    "Contract",
    "DeepSpeed",
    "DeepSpeedConfigError",
    "ModelRecipe",
    "ShardedState",
    "StateFormat",
    "Strategy",
    "StrategyLoadError",
    "WholeState",
    "deepspeed_config",
    "host_copy",
    "make_strategy",
    "state_format_named",
    "strategy_class",
    "strategy_classes",
    "strategy_of",
    "unwrap",
]


class StrategyLoadError(ValueError):
    """A registered strategy's wing does not load (its package's import fails, or the entry
    point names no Strategy of that name)."""


def strategy_class(name: str) -> type[Strategy]:
    """The wing the registry (config/strategies.py) names for `train.strategy` `name`."""
    wing = strategy_entry(name).wing
    module, _, attr = wing.partition(":")
    fix = "reinstall the package that registers it, or choose another train.strategy"
    try:
        cls = getattr(importlib.import_module(module), attr)
    except Exception as e:  # a plugin's own failure, whatever it raises
        raise StrategyLoadError(
            f"train.strategy {name!r}: its wing {wing} does not load "
            f"({type(e).__name__}: {e}). Fix: {fix}"
        ) from e
    if not (isinstance(cls, type) and issubclass(cls, Strategy)) or cls.name != name:
        raise StrategyLoadError(
            f"train.strategy {name!r}: {wing} is not a Strategy named {name!r}. Fix: {fix}"
        )
    return cls


def strategy_classes() -> dict[str, type[Strategy]]:
    """Every registered strategy's wing that loads, by name; one that does not is warned of and
    left out (a broken plugin costs only the runs that name it)."""
    out = {}
    for name in strategies():
        try:
            out[name] = strategy_class(name)
        except StrategyLoadError as e:
            warnings.warn(f"{e}; left out of the strategies", stacklevel=2)
    return out


def state_format_named(name: Any) -> type[StateFormat] | None:
    """The state format meta.json's `state_format` names, among the registered strategies'
    (None: none is called so)."""
    for cls in strategy_classes().values():
        if cls.state_format.name == name:
            return cls.state_format
    return None


def make_strategy(name: str, **options: Any) -> Strategy:
    """The strategy called `name` (`train.strategy`) with its options."""
    return strategy_class(name)(**options)


def strategy_of(model: nn.Module, **options: Any) -> Strategy:
    """The strategy a model wrapped by the caller was wrapped for, bound to it."""
    if is_fsdp(model):
        return FSDP(**options).adopt(model)
    return DDP().adopt(model)
