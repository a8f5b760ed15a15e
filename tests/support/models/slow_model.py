"""A user model factory whose training forward takes a set time, so that a run lasts long enough
for a node to leave or join mid-run, and which can hold a worker group of one size at a set
point until the cluster changes under it (the group is then restarted at another size)."""

import time
from pathlib import Path

import torch.distributed as dist
from torch import nn

from rayacc.models.mlp import MLP


class Slow(nn.Module):
    def __init__(
        self,
        inner: nn.Module,
        delay_s: float,
        holds: dict[int, int],
        hold_max_s: float,
        held: str | None,
        slow_rank: int | None = None,
        row_delay_s: float = 0.0,
    ):
        super().__init__()
        self.inner = inner
        self.delay_s, self.row_delay_s = delay_s, row_delay_s
        self.slow_rank = slow_rank
        self.holds = holds
        self.hold_max_s = hold_max_s
        self.held = held
        self.forwards = 0

    def forward(self, x):
        if self.training:
            self.forwards += 1
            world = dist.get_world_size() if dist.is_initialized() else 1
            if world in self.holds and self.forwards > self.holds[world]:
                del self.holds[world]
                marker = Path(f"{self.held}.{world}") if self.held else None
                if marker is None or not marker.exists():
                    if marker is not None:
                        marker.touch()  # once a run: a later group of this size goes on
                    # wait for the resize that ends this group; past the cap it goes on as is
                    time.sleep(self.hold_max_s)
            rank = dist.get_rank() if dist.is_initialized() else 0
            if self.slow_rank is None or rank == self.slow_rank:
                time.sleep(self.delay_s + self.row_delay_s * len(x))
        return self.inner(x)


def build(
    dataset,
    delay_s: float = 0.1,
    hidden: int = 32,
    holds: dict | None = None,
    hold_max_s: float = 240.0,
    held: str | None = None,
    slow_rank: int | None = None,
    dropout: float = 0.0,
    row_delay_s: float = 0.0,
) -> nn.Module:
    """`holds`: worker count → forwards; a group of that many workers stops in its forward
    number `forwards + 1` (counted per process: a restarted group counts from 0) for up to
    `hold_max_s` seconds; with `held` (a path prefix) only the first group of that size in the
    run holds. `slow_rank`: only that rank's forwards take `delay_s`, and `row_delay_s` a row
    (a straggler; a slower device is slower per row)."""
    mlp = MLP(dataset.num_features, dataset.num_classes, [hidden], dropout)
    holds = {int(w): n for w, n in (holds or {}).items()}
    return Slow(mlp, delay_s, holds, hold_max_s, held, slow_rank, row_delay_s)
