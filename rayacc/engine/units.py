"""Which modules of a model are its blocks (the units FSDP shards and activation checkpointing
recomputes), whether a model is sharded, and which of its parameters are frozen (not state: the
build makes them, a checkpoint leaves them out): light checks that import nothing of FSDP, so a DDP
run does not pay for loading it (about 0.7 s of every worker's start on 2 cores)."""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

__all__ = [
    "GRAD_SYNC_MODES",
    "frozen_names",
    "fsdp_blocks",
    "is_ddp",
    "is_fsdp",
    "load_weights",
    "unwrap",
    "without_frozen",
]

GRAD_SYNC_MODES = ("every_micro_step", "window_end")


def is_fsdp(model: nn.Module) -> bool:
    """Whether `model` was sharded with `fully_shard` (FSDP2)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    # a model can only be sharded once the FSDP package has been loaded
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules sharded as units of their own (and recomputed by activation checkpointing):
    `model.fsdp_blocks()` when the model names them (the hook for user factories), else the
    entries of a `blocks` ModuleList (the `gpt` model's transformer blocks), else none."""
    named = getattr(model, "fsdp_blocks", None)
    if callable(named):
        return list(named())
    blocks = getattr(model, "blocks", None)
    return list(blocks) if isinstance(blocks, nn.ModuleList) else []


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DistributedDataParallel and torch.compile wrappers."""
    while True:
        if is_ddp(model):
            model = model.module
        elif type(model).__name__ == "OptimizedModule":  # torch.compile's wrapper
            model = model._orig_mod
        else:
            return model


def is_ddp(model: nn.Module) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def frozen_names(model: nn.Module) -> set[str]:
    """The state-dict names of the model's frozen parameters (a tied one under each name)."""
    params = unwrap(model).named_parameters(remove_duplicate=False)
    return {name for name, p in params if not p.requires_grad}


def without_frozen(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    frozen = frozen_names(model)
    return {k: v for k, v in state.items() if k not in frozen} if frozen else state


def load_weights(model: nn.Module, weights: dict[str, Any]) -> None:
    """`weights` into `model`: every value but its frozen parameters' (which may be there), and
    nothing else (ValueError naming what is missing or unknown)."""
    model = unwrap(model)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = sorted(set(missing) - frozen_names(model))
    if missing or unexpected:
        raise ValueError(
            f"the weights do not fit the model (missing {', '.join(missing[:3]) or 'none'}; "
            f"unknown {', '.join(unexpected[:3]) or 'none'})"
        )
