"""Every rank's figures, window by window, and the rank that holds the others back.

In data parallelism the step runs at the pace of the slowest rank: the others wait for it in
the gradient reduction. So a rank's own time — computing, waiting for its data, stepping its
optimizer, everything but waiting for its peers — is what tells ranks apart; its window time is
everyone's. The ranks' figures of a window reach rank 0 inside the window's own reduction
(`AccumulationStep(rank_report=...)`), one window late, and are judged here over logging
intervals of a tenth of the run.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["FIELDS", "PARTS", "RankWatch", "Straggler", "rank_report"]

FIELDS = ("compute_s", "data_s", "sync_s", "optimizer_s", "host_mb", "device_mb")
"""What each rank reports of its window, in this order."""
PARTS = ("compute_s", "data_s", "optimizer_s")
"""A rank's own time: the parts that make it slower than its peers. (Its gradient-sync wait is
shorter, not longer: the others wait for it. A slow link slows every rank's sync alike, which
`comm/sync_time_frac` shows, and no rank's figures single it out.)"""
PART_NAMES = {"compute_s": "compute", "data_s": "data", "optimizer_s": "optimizer"}
MIN_EXCESS_S = 0.1
"""A rank counts as slow only when its own time is also this much above the others' median:
windows of a few milliseconds (a small model, a CPU run on a busy machine) vary by more than
any ratio between even ranks, and a rank that costs every step under 0.1 s is not worth a
node's replacement."""


def rank_report(
    *,
    step_s: float,
    sync_s: float,
    optimizer_s: float,
    data_s: float,
    host_mb: float,
    device_mb: float,
) -> list[float]:
    """One rank's figures of one window, in `FIELDS` order."""
    compute_s = max(0.0, step_s - sync_s - optimizer_s)
    return [compute_s, data_s, sync_s, optimizer_s, host_mb, device_mb]


@dataclass(frozen=True)
class Straggler:
    """A rank whose own time stayed above the others' median for consecutive intervals."""

    step: int
    rank: int
    node: str
    part: str
    """`compute`, `data` or `optimizer`: the part furthest above the others' median."""
    ratio: float
    """The rank's own time over the others' median, in the last interval."""
    rank_s: float
    others_s: float
    intervals: int

    def describe(self) -> str:
        """The entry kept in the run's `rayacc.stragglers` tag."""
        return (
            f"step {self.step}: rank {self.rank} on node {self.node or '?'}, {self.part} "
            f"({self.ratio:.2f}× the others' median)"
        )

    def console_line(self) -> str:
        return (
            f"straggler at step {self.step}: rank {self.rank} on node {self.node or '?'} is "
            f"slow in {self.part} — {self.rank_s * 1000:.0f} ms of its own per window against "
            f"the others' median {self.others_s * 1000:.0f} ms ({self.ratio:.2f}×) for "
            f"{self.intervals} logging intervals; every step waits for it"
        )


_COMPUTE, _DATA, _OPTIMIZER = (FIELDS.index(p) for p in PARTS)
FOLD_EVERY = 256


class RankWatch:
    """Rank 0's view of every rank: per window, the median and the slowest rank's own time;
    per logging interval, each rank's means (memory: its peak) and whether a straggler is to
    be named. `margin`: how far above the others' median a rank's own time must stay
    (0.3 = 30 %), for `patience` consecutive intervals."""

    def __init__(
        self,
        interval_steps: int,
        *,
        margin: float = 0.3,
        patience: int = 2,
        nodes: Sequence[str] = (),
        system: Sequence[str] = (),
    ):
        """`system`: names of the node figures that follow `FIELDS` in every report (MLflow's
        system metrics, sampled by the first rank of each node): logged per node at each
        interval's end as `system/<node>/<name>`."""
        self.interval_steps = max(1, interval_steps)
        self.margin, self.patience, self.nodes = margin, patience, tuple(nodes)
        self.system = tuple(system)
        self._interval: list[Sequence[Sequence[float]]] = []
        """The reports not yet folded into `_folded`: adding them up window by window would
        cost every step more (this runs on rank 0 between windows); folded every
        `FOLD_EVERY` windows, so a long interval on many ranks holds little."""
        self._folded: tuple[int, list[list[float]], list[list[float]]] | None = None
        """(windows, per rank sums, per rank peaks) of the interval's folded reports."""
        self._streaks: dict[int, int] = {}
        self._named: set[int] = set()
        self._world = 0

    @staticmethod
    def interval_for(total_steps: int) -> int:
        """A tenth of the run, at least one step."""
        return max(1, math.ceil(total_steps / 10))

    def window(
        self, step: int, reports: Sequence[Sequence[float]]
    ) -> tuple[dict[str, float], Straggler | None]:
        """The ranks' figures arriving with `step`: metrics for its record (per window, and
        per rank at an interval's end) and a straggler newly named, if any."""
        if not reports:
            return {}, None
        # every window, on rank 0 between windows: as little as it takes
        own = [r[_COMPUTE] + r[_DATA] + r[_OPTIMIZER] for r in reports]
        top = max(own)
        ranked = sorted(own)
        mid = len(ranked) // 2
        metrics = {
            "ranks/own_s_median": ranked[mid]
            if mid * 2 != len(ranked)
            else (ranked[mid - 1] + ranked[mid]) / 2,
            "ranks/own_s_max": top,
            "ranks/slowest": float(own.index(top)),
        }
        if len(reports) != self._world:  # another worker count: start over
            self._interval, self._folded = [], None
            self._streaks.clear()
            self._named.clear()
            self._world = len(reports)
        self._interval.append(reports)
        if step % self.interval_steps:
            if len(self._interval) >= FOLD_EVERY:
                self._fold()
            return metrics, None
        self._fold()
        assert self._folded is not None
        windows, sums, peaks = self._folded
        self._folded = None
        means = [[v / windows for v in rank] for rank in sums]
        for r, (mean, peak) in enumerate(zip(means, peaks, strict=True)):
            for i, name in enumerate(FIELDS):
                metrics[f"rank_{r}/{name}"] = peak[i] if name.endswith("_mb") else mean[i]
            metrics[f"rank_{r}/own_s"] = sum(mean[FIELDS.index(p)] for p in PARTS)
        for node, r in self._first_rank_of_each_node(len(means)).items():
            for i, name in enumerate(self.system):
                metrics[f"system/{node}/{name}"] = means[r][len(FIELDS) + i]
        return metrics, self._judge(step, means)

    def _fold(self) -> None:
        """Adds the pending reports to the interval's sums and peaks."""
        pending, self._interval = self._interval, []
        if not pending:
            return
        # per rank, per figure: its values over the pending windows
        columns = [list(zip(*rank, strict=True)) for rank in zip(*pending, strict=True)]
        sums = [[sum(c) for c in rank] for rank in columns]
        peaks = [[max(c) for c in rank] for rank in columns]
        if self._folded is not None:
            n, old_sums, old_peaks = self._folded
            sums = [
                [a + b for a, b in zip(x, y, strict=True)]
                for x, y in zip(old_sums, sums, strict=True)
            ]
            peaks = [
                [max(a, b) for a, b in zip(x, y, strict=True)]
                for x, y in zip(old_peaks, peaks, strict=True)
            ]
            self._folded = (n + len(pending), sums, peaks)
        else:
            self._folded = (len(pending), sums, peaks)

    def _first_rank_of_each_node(self, world: int) -> dict[str, int]:
        """Node label (in a metric name: `/` is a level there) → the rank that samples it."""
        if not self.system:
            return {}
        first: dict[str, int] = {}
        for r in range(world):
            node = self.nodes[r] if r < len(self.nodes) else f"rank{r}"
            first.setdefault(node.replace("/", "-"), r)
        return first

    def _judge(self, step: int, means: list[list[float]]) -> Straggler | None:
        """Each rank's own time against the median of the others'; a rank above it by the
        margin (and MIN_EXCESS_S) for `patience` intervals in a row is named, once per streak."""
        if len(means) < 2:
            return None
        own = [sum(m[FIELDS.index(p)] for p in PARTS) for m in means]
        named = None
        for r, mine in enumerate(own):
            others = statistics.median(own[:r] + own[r + 1 :])
            slow = mine > others * (1 + self.margin) and mine - others > MIN_EXCESS_S
            self._streaks[r] = self._streaks.get(r, 0) + 1 if slow else 0
            if not slow:
                self._named.discard(r)
                continue
            if self._streaks[r] < self.patience or r in self._named or named is not None:
                continue
            self._named.add(r)
            part = max(
                PARTS,
                key=lambda p: (
                    means[r][FIELDS.index(p)]
                    - statistics.median(m[FIELDS.index(p)] for i, m in enumerate(means) if i != r)
                ),
            )
            named = Straggler(
                step=step,
                rank=r,
                node=self.nodes[r] if r < len(self.nodes) else "",
                part=PART_NAMES[part],
                ratio=mine / others if others > 0 else math.inf,
                rank_s=mine,
                others_s=others,
                intervals=self._streaks[r],
            )
        return named
