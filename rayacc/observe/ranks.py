"""Every rank's figures, window by window, and the rank that holds the others back.

In data parallelism the step runs at the pace of the slowest rank: the others wait for it in
the gradient reduction. So a rank's own time — computing, waiting for its data, stepping its
optimizer, everything but waiting for its peers — is what tells ranks apart; its window time is
everyone's. The ranks' figures of a window reach rank 0 inside the window's own reduction
(`AccumulationStep(figures=...)`), one window late, and are judged here over logging
intervals of a tenth of the run — on the driver (`observe/relay.py`), off the step: rank 0
only hands them over with the step's record.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "FIELDS",
    "FIGURES_KEY",
    "PARTS",
    "TIME_KEY",
    "Straggler",
    "StragglerJudge",
    "rank_figures",
]

FIGURES_KEY = "_rank_figures"
"""Where every rank's figures of a window travel in rank 0's hand-over of the step's record
(the driver takes them out before anything logs the record)."""

TIME_KEY = "time"
"""When the step ended on rank 0 (`time.time()`), in its record: what the console's elapsed time
and ETA count (records reach the driver in bursts) and MLflow's timestamp of the step's
metrics; no metric itself."""

FIELDS = ("compute_s", "data_s", "sync_s", "optimizer_s", "own_s", "host_mb", "device_mb")
"""What each rank reports of its window, in this order. `own_s`: its own time, the sum of
`PARTS`, added up by each rank for itself rather than by rank 0 for everyone between
windows."""
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


def rank_figures(
    *,
    step_s: float,
    sync_s: float,
    optimizer_s: float,
    data_s: float,
    host_mb: float,
    device_mb: float,
) -> list[float]:
    """One rank's figures of one window, in `FIELDS` order."""
    compute_s = step_s - sync_s - optimizer_s
    if compute_s < 0.0:  # clock jitter on a window of almost nothing
        compute_s = 0.0
    own_s = compute_s + data_s + optimizer_s
    return [compute_s, data_s, sync_s, optimizer_s, own_s, host_mb, device_mb]


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
    place: str = ""
    """Its place on the mesh (`dp 1 · tp 0`) where ranks are more than data-parallel ranks."""

    @property
    def _who(self) -> str:
        place = f" ({self.place})" if self.place else ""
        return f"rank {self.rank}{place} on node {self.node or '?'}"

    def describe(self) -> str:
        """The entry kept in the run's `rayacc.stragglers` tag."""
        return f"step {self.step}: {self._who}, {self.part} ({self.ratio:.2f}× the others' median)"

    def console_line(self) -> str:
        return (
            f"straggler at step {self.step}: {self._who} is "
            f"slow in {self.part} — {self.rank_s * 1000:.0f} ms of its own per window against "
            f"the others' median {self.others_s * 1000:.0f} ms ({self.ratio:.2f}×) for "
            f"{self.intervals} logging intervals; every step waits for it"
        )


_OWN = FIELDS.index("own_s")
_AT = {p: FIELDS.index(p) for p in PARTS}


def _middle(ranked: Sequence[float]) -> float:
    """The median of values already sorted: statistics.median without its type dispatch
    (several times the cost on a few values)."""
    mid = len(ranked) // 2
    return ranked[mid] if len(ranked) % 2 else (ranked[mid - 1] + ranked[mid]) / 2


def _median(values: list[float]) -> float:
    return _middle(sorted(values))


FOLD_EVERY = 256


class StragglerJudge:
    """The driver's view of every rank (`observe/relay.py`): per window, the median and the
    slowest rank's own time; per logging interval, each rank's means (memory: its peak) and
    whether a straggler is to be named. `margin`: how far above the others' median a rank's
    own time must stay (0.3 = 30 %), for `patience` consecutive intervals.

    A window's figures arrive flat, as the step's reduction leaves them
    (`StepResult.group_figures`: rank r's report at [r·k, (r+1)·k)); they are read in place,
    never cut into one sequence per rank between windows."""

    def __init__(
        self,
        interval_steps: int,
        *,
        margin: float = 0.3,
        patience: int = 2,
        nodes: Sequence[str] = (),
        system: Sequence[str] = (),
        places: Sequence[str] = (),
    ):
        """`system`: names of the node figures that follow `FIELDS` in every report (MLflow's
        system metrics, sampled by the first rank of each node): logged per node at each
        interval's end as `system/<node>/<name>`."""
        self.interval_steps = max(1, interval_steps)
        self.margin, self.patience, self.nodes = margin, patience, tuple(nodes)
        self.places = tuple(places)
        """Every rank's place on the mesh (`RunStarted.places`), named with a straggler."""
        self.system = tuple(system)
        self.width = len(FIELDS) + len(self.system)
        """Figures in one rank's report."""
        self._pending: list[float] = []
        """The figures of the interval's windows not yet in `_totals`, one window after
        the other in one list (adding them up window by window costs more); folded every
        `FOLD_EVERY` windows, so a long interval on many ranks holds little."""
        self._windows = 0
        self._totals: list[float] = []
        """Per figure of each rank, over the interval's folded windows: its sum, or its peak
        where `_peak_at` (memory); `_nothing` (0, or −inf for a peak) before any."""
        self._nothing: list[float] = []
        self._peak_at: list[bool] = []
        self._streaks: dict[int, int] = {}
        self._named: set[int] = set()
        self._size = -1
        self._fold_at = 0
        self._names: list[tuple[int, str]] = []
        """(flat index, metric name) of every rank's `FIELDS`, for the world of `_size`
        figures."""

    @staticmethod
    def interval_for(total_steps: int) -> int:
        """A tenth of the run, at least one step."""
        return max(1, math.ceil(total_steps / 10))

    def window(
        self, step: int, figures: Sequence[float], into: dict | None = None
    ) -> tuple[dict[str, float], Straggler | None]:
        """Every rank's figures of the window arriving with `step`, flat in rank order:
        metrics for its record (per window, and per rank at an interval's end) and a straggler
        newly named, if any. `into`: the record to write the metrics in (returned as them),
        instead of a dict of their own for the caller to merge."""
        metrics = {} if into is None else into
        if len(figures) != self._size:  # the first window, or another worker count
            if not figures:
                return metrics, None
            self._start_over(len(figures))
        # every window, for every record the driver relays: as little as it takes
        own = figures[_OWN :: self.width]
        ranked = sorted(own)
        top = ranked[-1]
        metrics["ranks/own_s_median"] = _middle(ranked)
        metrics["ranks/own_s_max"] = top
        metrics["ranks/slowest"] = float(own.index(top))
        self._pending += figures
        if step % self.interval_steps:
            if len(self._pending) >= self._fold_at:
                self._fold()
            return metrics, None
        return metrics, self._interval_end(step, metrics)

    def _interval_end(self, step: int, metrics: dict) -> Straggler | None:
        """Each rank's means over the interval (memory: its peak) into `metrics`; a straggler
        newly named, if any."""
        self._fold()  # the window just in at least
        n, totals = self._windows, self._totals
        self._windows, self._totals = 0, self._nothing
        means = [t if peak else t / n for t, peak in zip(totals, self._peak_at, strict=True)]
        for i, name in self._names:
            metrics[name] = means[i]
        k = self.width
        for node, r in self._first_rank_of_each_node(len(means) // k).items():
            for i, name in enumerate(self.system, start=r * k + len(FIELDS)):
                metrics[f"system/{node}/{name}"] = means[i]
        return self._judge(step, means)

    def _start_over(self, size: int) -> None:
        if size % self.width:
            raise ValueError(
                f"{size} rank figures do not split into reports of {self.width} "
                f"({len(FIELDS)} FIELDS and {len(self.system)} system figures)"
            )
        self._pending, self._windows = [], 0
        self._streaks.clear()
        self._named.clear()
        self._size = size
        self._fold_at = FOLD_EVERY * size
        world = size // self.width
        self._names = [
            (r * self.width + i, f"rank_{r}/{name}")
            for r in range(world)
            for i, name in enumerate(FIELDS)
        ]
        self._peak_at = [name.endswith("_mb") for name in FIELDS + self.system] * world
        self._nothing = [-math.inf if peak else 0.0 for peak in self._peak_at]
        self._totals = self._nothing

    def _fold(self) -> None:
        """Adds the pending windows to the interval's totals: sums, and peaks of memory."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        size = self._size
        # per figure of each rank: its total so far with its values over the pending windows
        self._totals = [
            max(t, *pending[i::size]) if peak else t + sum(pending[i::size])
            for i, (t, peak) in enumerate(zip(self._totals, self._peak_at, strict=True))
        ]
        self._windows += len(pending) // size

    def _first_rank_of_each_node(self, world: int) -> dict[str, int]:
        """Node label (in a metric name: `/` is a level there) → the rank that samples it."""
        if not self.system:
            return {}
        first: dict[str, int] = {}
        for r in range(world):
            node = self.nodes[r] if r < len(self.nodes) else f"rank{r}"
            first.setdefault(node.replace("/", "-"), r)
        return first

    def _judge(self, step: int, means: list[float]) -> Straggler | None:
        """Each rank's own time against the median of the others'; a rank above it by the
        margin (and MIN_EXCESS_S) for `patience` intervals in a row is named, once per
        streak. `means`: every rank's interval means, flat as the figures."""
        k = self.width
        own = means[_OWN::k]
        if len(own) < 2:
            return None
        named = None
        for r, mine in enumerate(own):
            others = _median(own[:r] + own[r + 1 :])
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
                    means[r * k + _AT[p]]
                    - _median([means[i * k + _AT[p]] for i in range(len(own)) if i != r])
                ),
            )
            named = Straggler(
                step=step,
                rank=r,
                node=self.nodes[r] if r < len(self.nodes) else "",
                place=self.places[r] if r < len(self.places) else "",
                part=PART_NAMES[part],
                ratio=mine / others if others > 0 else math.inf,
                rank_s=mine,
                others_s=others,
                intervals=self._streaks[r],
            )
        return named
