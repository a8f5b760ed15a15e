"""A user model factory that takes a set time per training forward, so that a run lasts long
enough for a node to leave or join mid-run."""

import time

from torch import nn

from rayacc.models.mlp import MLP


class Slow(nn.Module):
    def __init__(self, inner: nn.Module, delay_s: float):
        super().__init__()
        self.inner = inner
        self.delay_s = delay_s

    def forward(self, x):
        if self.training:
            time.sleep(self.delay_s)
        return self.inner(x)


def build(dataset, delay_s: float = 0.1, hidden: int = 32) -> nn.Module:
    return Slow(MLP(dataset.num_features, dataset.num_classes, [hidden]), delay_s)
