"""A user model factory whose training forward "runs out of CUDA memory" on micro-batches of
`threshold` rows or more when DDP runs it (the auto search measures the bare module, where it
fits): what a search that chose a size too close to the limit meets in training. With
`always=True` every training forward of that size runs out (a sharded model's search trials
too); with `rank_only`, only on that rank of the process group (a rank-safe probe must
still agree)."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from rayacc.models.mlp import MLP


class OutOfMemoryInTraining(nn.Module):
    def __init__(
        self, inner: nn.Module, threshold: int, always: bool = False, rank_only: int | None = None
    ):
        super().__init__()
        self.inner = inner
        self.threshold = threshold
        self.always = always
        self.rank_only = rank_only

    def forward(self, x):
        in_ddp = any(f.function == "_run_ddp_forward" for f in inspect.stack(context=0))
        here = self.rank_only is None or torch.distributed.get_rank() == self.rank_only
        if here and (in_ddp or (self.always and self.training)) and x.shape[0] >= self.threshold:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return self.inner(x)


def build(
    dataset, threshold: int, hidden: int = 32, always: bool = False, rank_only: int | None = None
) -> nn.Module:
    return OutOfMemoryInTraining(
        MLP(dataset.num_features, dataset.num_classes, [hidden]), threshold, always, rank_only
    )
