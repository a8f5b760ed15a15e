"""DDP: every rank holds the whole model (DistributedDataParallel)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from rayacc.engine.collectives import all_reduce
from rayacc.engine.parallel.base import (
    CommStats,
    ModelRecipe,
    Strategy,
    _checkpoint_blocks,
    _world,
)
from rayacc.engine.parallel.state import WholeState
from rayacc.engine.sync import CommCounter, install_comm_counter
from rayacc.engine.units import is_ddp

__all__ = ["DDP"]


class DDP(Strategy):
    """Every rank holds the whole model; gradients are all-reduced in buckets during the
    window's last backward (DistributedDataParallel; `no_sync` on the micro-steps before)."""

    name = "ddp"
    state_format = WholeState

    @classmethod
    def describe(cls, cfg) -> str:
        return "DDP (the whole model on every rank)"

    def __init__(self) -> None:
        super().__init__()
        self.state = WholeState()
        self.comm: CommCounter | None = None

    def _build(self, recipe: ModelRecipe, device: torch.device) -> nn.Module:
        module = recipe.build()
        _checkpoint_blocks(module, recipe)
        module = module.to(device)
        if recipe.compile:
            # compiled before DDP wraps it: no_sync and the gradient hooks stay outside it
            module = torch.compile(module)
        if _world() == 1:
            return module
        ids = [device.index if device.index is not None else 0] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(module, device_ids=ids)

    def setup_reduction(self, count_comm: bool) -> bool:
        assert self.model is not None
        if _world() > 1 and not is_ddp(self.model):
            raise ValueError(
                f"torch.distributed runs {_world()} ranks but the model is neither wrapped in "
                "DistributedDataParallel nor sharded with fully_shard: gradients would never "
                "sync. Build it with a strategy (or wrap it)."
            )
        # the engine's hook sums gradients over ranks; DDP's default one averages
        self.comm = install_comm_counter(self.model, average=False) if count_comm else None
        return self.comm is not None or not is_ddp(self.model)

    def sync_context(self, sync: bool) -> contextlib.AbstractContextManager[None]:
        # around forward *and* backward: DDP marks what to reduce during forward, so a
        # `no_sync` around backward alone still all-reduces
        if sync or not is_ddp(self.model):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def local_gradients(self):
        return self.comm.local if self.comm is not None else None

    def attach_window_stats(self, stats: torch.Tensor, exact_in_fp32: bool) -> None:
        if self.comm is not None:
            self.comm.attach_window_stats(stats, exact_in_fp32=exact_in_fp32)

    def reduced_window_stats(self, stats: torch.Tensor, group=None) -> torch.Tensor:
        reduced = self.comm.reduced_window_stats() if self.comm is not None else None
        return reduced if reduced is not None else all_reduce(stats, group=group)

    def grad_norm(self, grads: list[torch.Tensor], uniform: bool) -> torch.Tensor:
        if uniform:
            # get_total_norm without its grouping by device and dtype, which costs as much as
            # the norms on a small model
            return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        return torch.nn.utils.get_total_norm(grads)

    def begin_window(self) -> None:
        if self.comm is not None:
            self.comm.begin_window()

    def comm_stats(self, micro_steps: int) -> CommStats:
        if self.comm is None:
            return CommStats()
        return CommStats(
            allreduce_calls=self.comm.launches,
            sync_passes=self.comm.passes,
            sync_time_s=self.comm.sync_time_s(),
        )
