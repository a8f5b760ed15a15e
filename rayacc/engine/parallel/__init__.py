"""The parallel strategy: everything that differs between replicating a model (DDP) and sharding
it (FSDP2), behind one interface, so that the accumulation step, the micro-batch search and the
worker never ask which one runs.

A strategy owns: building and wrapping the model (materialising a meta-device model's shards,
buffers included), the context a micro-step's forward and backward run in (when gradients
sync), the gradient reduction (a sum over ranks: the step's one multiply by 1 / N_window is the
whole normalisation), the gradient norm, whether forwards are collectives (then the ranks agree
on every count of forwards first), whether an out-of-memory error can be retried in place,
dropping every gradient it holds (internal buffers too), its communication accounting, and
and how its state goes into a checkpoint (composed: `state`, a `StateFormat` of
`parallel/state.py`). One module per strategy (`base`: the interface
and what they share; `ddp`; `fsdp`; `deepspeed`, whose engine owns the backward and the step);
another strategy (HSDP, say) is one more module.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from rayacc.engine.parallel.base import CommStats, ModelRecipe, Strategy, host_copy, unwrap
from rayacc.engine.parallel.ddp import DDP
from rayacc.engine.parallel.deepspeed import DeepSpeed, DeepSpeedConfigError, deepspeed_config
from rayacc.engine.parallel.fsdp import FSDP
from rayacc.engine.parallel.state import SHARDS_DIR, ShardedState, StateFormat, WholeState
from rayacc.engine.units import is_fsdp

__all__ = [
    "DDP",
    "FSDP",
    "SHARDS_DIR",
    "STRATEGIES",
    "CommStats",
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
