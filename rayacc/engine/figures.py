"""Every rank's figures of a window (its times and memory: observe/ranks.py) to every rank,
riding the reduction the window makes anyway: each rank writes its own slots of a vector of
every rank's and the reduction sums them. Under tensor parallelism that reduction spans the
data-parallel ranks only (a tensor-parallel group reads one share); one all-reduce of the
slots over the tensor-parallel group completes them, so every rank of the mesh is seen."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from rayacc.engine.collectives import all_reduce

__all__ = ["RankFigures"]


class RankFigures:
    """A step's figures of every rank. `group`: the window's reduction group; `rest`: the
    group that holds the ranks it leaves out (the tensor-parallel group), or None."""

    def __init__(self, group, rest=None):
        self.rest = rest
        if not (dist.is_available() and dist.is_initialized()):
            self.rank, self.world = 0, 1
        elif rest is not None:  # slots by the rank in the whole group
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def slots(self, figures: Sequence[float]) -> list[float]:
        """This rank's figures in its own slots (zeros elsewhere), for the reduction."""
        if not figures:
            return []
        k = len(figures)
        return [
            *[0.0] * (self.rank * k),
            *map(float, figures),
            *[0.0] * ((self.world - self.rank - 1) * k),
        ]

    def completed(self, reduced: Sequence[float], device: torch.device) -> tuple[float, ...]:
        """The slots as the reduction left them, with the ranks it left out added."""
        if self.rest is None or not reduced:
            return tuple(reduced)
        t = torch.tensor(list(reduced), dtype=torch.float64, device=device)
        return tuple(all_reduce(t, group=self.rest).tolist())
