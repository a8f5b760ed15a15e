"""Which modules of a model are its blocks (the units FSDP shards and activation checkpointing
recomputes), and whether a model is sharded: light checks that import nothing of FSDP, so a DDP
run does not pay for loading it (about 0.7 s of every worker's start on 2 cores)."""

from __future__ import annotations

import sys

from torch import nn

__all__ = ["GRAD_SYNC_MODES", "fsdp_blocks", "is_ddp", "is_fsdp", "unwrap"]

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
