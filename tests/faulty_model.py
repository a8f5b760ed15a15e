"""A user model factory whose rank-1 worker process dies once, mid-run (a real process exit,
not an exception), to exercise recovery from the latest checkpoint."""

from __future__ import annotations

import os

from torch import nn

from rayacc.models.mlp import MLP


class DiesOnce(nn.Module):
    def __init__(self, inner: nn.Module, marker: str, die_at_forward: int):
        super().__init__()
        self.inner = inner
        self.marker = marker
        self.die_at_forward = die_at_forward
        self.training_forwards = 0

    def forward(self, x):
        if self.training:
            self.training_forwards += 1
            if self.training_forwards == self.die_at_forward and not os.path.exists(self.marker):
                import ray.train

                if ray.train.get_context().get_world_rank() == 1:
                    open(self.marker, "w").close()
                    os._exit(1)
        return self.inner(x)


def build(
    dataset, marker: str, die_at_forward: int, hidden: int = 32, dropout: float = 0.0
) -> nn.Module:
    return DiesOnce(
        MLP(dataset.num_features, dataset.num_classes, [hidden], dropout), marker, die_at_forward
    )
