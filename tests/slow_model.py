"""A user model factory whose training forward takes a set time, so that a run lasts long enough
for a node to leave or join mid-run, and which can hold a worker group of one size at a set
point until the cluster changes under it (the group is then restarted at another size)."""

import time

import torch.distributed as dist
from torch import nn

from rayacc.models.mlp import MLP


class Slow(nn.Module):
    def __init__(
        self, inner: nn.Module, delay_s: float, hold_world: int, hold_after: int, hold_max_s: float
    ):
        super().__init__()
        self.inner = inner
        self.delay_s = delay_s
        self.hold_world = hold_world
        self.hold_after = hold_after
        self.hold_max_s = hold_max_s
        self.forwards = 0

    def forward(self, x):
        if self.training:
            self.forwards += 1
            world = dist.get_world_size() if dist.is_initialized() else 1
            if world == self.hold_world and self.forwards > self.hold_after:
                # wait for the resize that ends this group; past the cap the run goes on as is
                time.sleep(self.hold_max_s)
                self.hold_world = 0
            time.sleep(self.delay_s)
        return self.inner(x)


def build(
    dataset,
    delay_s: float = 0.1,
    hidden: int = 32,
    hold_world: int = 0,
    hold_after: int = 0,
    hold_max_s: float = 240.0,
) -> nn.Module:
    """`hold_world` > 0: a group of that many workers stops in its forward number
    `hold_after + 1` (counted per process) for up to `hold_max_s` seconds."""
    mlp = MLP(dataset.num_features, dataset.num_classes, [hidden])
    return Slow(mlp, delay_s, hold_world, hold_after, hold_max_s)
