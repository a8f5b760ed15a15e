"""The data order in global-sample units (docs/design.md), in plain numpy.

Each epoch has one seeded order of all training rows. Optimizer step s of the epoch consumes
positions [s·G, (s+1)·G) of that order; rank r takes its contiguous share of the window (equal
shares, or uneven ones where the ranks do not divide G) and splits it into micro-batches. The
order depends on the seed and the epoch only, so any (workers, shares, micro, accum) with the
same G sees the same samples at every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["DataOrder", "EpochLayout", "RankWindow", "epoch_order", "split_train_val"]


def split_train_val(num_rows: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Row ids held out for validation (a seeded choice, fixed for the run) and the rest."""
    n_val = round(num_rows * val_fraction)
    if val_fraction > 0 and n_val == 0:
        n_val = 1
    perm = np.random.default_rng([seed, 0x5EED]).permutation(num_rows)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def epoch_order(train_ids: np.ndarray, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """Row ids of the training set in the order epoch `epoch` consumes them."""
    if not shuffle:
        return train_ids
    return train_ids[np.random.default_rng([seed, epoch]).permutation(len(train_ids))]


@dataclass(frozen=True)
class RankWindow:
    """One rank's part of one optimizer step: positions in the epoch order, per micro-batch."""

    step_in_epoch: int
    micro_batches: list[np.ndarray]
    window_samples: int
    """Samples of the whole window over all ranks (G, or fewer in a short last window)."""


@dataclass(frozen=True)
class EpochLayout:
    """How an epoch of `num_rows` rows splits into windows of `global_batch_size`."""

    num_rows: int
    global_batch_size: int
    micro_batch_size: int
    num_workers: int
    last_window: str = "short"
    shares: tuple[int, ...] = ()
    """Rows of a full window per rank where they are uneven (`BatchSplit.shares`); empty:
    G / num_workers each."""

    @property
    def rank_shares(self) -> tuple[int, ...]:
        return self.shares or (self.global_batch_size // self.num_workers,) * self.num_workers

    @property
    def micro_steps(self) -> int:
        """Micro-steps of a full window on every rank: as many as the largest share needs."""
        return -(-max(self.rank_shares) // self.micro_batch_size)

    @property
    def full_windows(self) -> int:
        return self.num_rows // self.global_batch_size

    @property
    def leftover_rows(self) -> int:
        return self.num_rows % self.global_batch_size

    @property
    def short_window_rows(self) -> int:
        """Rows of the short last window (0 when there is none)."""
        if self.last_window == "drop" or self.leftover_rows < self.num_workers:
            # fewer rows than ranks would leave a rank without data for the window
            return 0
        if self.micro_batch_size == 1:
            # micro-batches of 1 run a rank's share in as many micro-steps as it has rows: a
            # rank one row short would run an empty one (the rows that do not divide are dropped)
            return self.leftover_rows - self.leftover_rows % self.num_workers
        return self.leftover_rows

    @property
    def dropped_rows(self) -> int:
        return self.leftover_rows - self.short_window_rows

    @property
    def steps_per_epoch(self) -> int:
        return self.full_windows + (1 if self.short_window_rows else 0)

    def describe(self) -> str:
        if self.full_windows == 0 and self.short_window_rows:
            return (
                f"{self.num_rows} training rows = one short window of {self.short_window_rows} "
                f"rows (fewer than the global batch of {self.global_batch_size})"
            )
        text = (
            f"{self.num_rows} training rows = {self.full_windows} windows of "
            f"{self.global_batch_size}"
        )
        if self.leftover_rows == 0:
            return text
        if self.short_window_rows == self.leftover_rows:
            return (
                text
                + f" + a short last window of {self.short_window_rows} rows (last_window=short)"
            )
        if self.short_window_rows:
            return (
                text + f" + a short last window of {self.short_window_rows} rows; the last "
                f"{self.dropped_rows} rows are dropped each epoch (micro-batches of 1 over "
                f"{self.num_workers} workers take a multiple of {self.num_workers})"
            )
        why = (
            "last_window=drop"
            if self.last_window == "drop"
            else f"fewer than {self.num_workers} workers"
        )
        return text + f"; the last {self.dropped_rows} rows are dropped each epoch ({why})"

    def rank_window(self, step_in_epoch: int, rank: int) -> RankWindow:
        """Positions (in the epoch order) of rank `rank`'s micro-batches at step `step_in_epoch`."""
        if not 0 <= step_in_epoch < self.steps_per_epoch:
            raise IndexError(
                f"step {step_in_epoch} outside an epoch of {self.steps_per_epoch} steps"
            )
        start = step_in_epoch * self.global_batch_size
        w = self.num_workers
        if step_in_epoch < self.full_windows:
            shares = self.rank_shares
            lo = start + sum(shares[:rank])
            positions = np.arange(lo, lo + shares[rank])
            # equal shares cut into whole micro-batches; uneven ones into the largest share's
            # count, as even as they go: no rank runs a micro-step (a collective) fewer
            parts = np.array_split(positions, self.micro_steps)
            return RankWindow(step_in_epoch, parts, self.global_batch_size)
        rows = self.short_window_rows
        base, extra = divmod(rows, w)
        lo = start + rank * base + min(rank, extra)
        positions = np.arange(lo, lo + base + (1 if rank < extra else 0))
        # the same number of micro-steps on every rank: as many as the largest share needs, so
        # no micro-batch exceeds the micro-batch size (memory; a pipeline's buffers)
        k = max(1, math.ceil((base + (1 if extra else 0)) / self.micro_batch_size))
        return RankWindow(step_in_epoch, list(np.array_split(positions, k)), rows)

    def rank_intervals(
        self, rank: int, stop_step: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rank `rank`'s positions in steps [0, stop_step) as one range [lo_s, hi_s) per step."""
        stop = self.steps_per_epoch if stop_step is None else min(stop_step, self.steps_per_epoch)
        full = min(stop, self.full_windows)
        shares = self.rank_shares
        lo = np.arange(full, dtype=np.int64) * self.global_batch_size + sum(shares[:rank])
        hi = lo + shares[rank]
        if stop > full:
            last = np.concatenate(self.rank_window(full, rank).micro_batches)
            lo, hi = np.append(lo, last[0]), np.append(hi, last[-1] + 1)
        return lo, hi

    def rank_positions(
        self, first_step: int, rank: int, stop_step: int | None = None
    ) -> np.ndarray:
        """Every position rank `rank` consumes in steps [first_step, stop_step) of the epoch."""
        stop = self.steps_per_epoch if stop_step is None else min(stop_step, self.steps_per_epoch)
        parts = [
            p for s in range(first_step, stop) for p in self.rank_window(s, rank).micro_batches
        ]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _expand(first: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every integer of the ranges [first_k, last_k] in turn, and the k each belongs to."""
    counts = last - first + 1
    owner = np.repeat(np.arange(len(first)), counts)
    starts = np.repeat(first - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    return starts + np.arange(counts.sum()), owner


@dataclass
class DataOrder:
    """The run's data order over *units* of consecutive rows: each unit is one Parquet row group
    (`chunks`), or one row (`rows`, today's exact per-row permutation).

    Validation holds out a seeded choice of whole units, fixed for the run. Epoch e orders the
    training units by a permutation seeded by (seed, e) and, with `chunks`, the rows inside each
    unit by one seeded by (seed, e, unit); with `shuffle` off both are the stored order. Position
    p of the epoch is a row id; the order depends on the seed and the epoch only."""

    unit_start: np.ndarray
    """First row id of each unit."""
    unit_size: np.ndarray
    seed: int
    shuffle: bool
    val_fraction: float
    chunked: bool

    def __post_init__(self) -> None:
        self.train_units, self.val_units = split_train_val(
            len(self.unit_size), self.val_fraction, self.seed
        )
        self._cached: tuple[int, np.ndarray, np.ndarray] | None = None

    @classmethod
    def by_rows(cls, num_rows: int, val_fraction: float, seed: int, shuffle: bool) -> DataOrder:
        return cls(
            np.arange(num_rows, dtype=np.int64),
            np.ones(num_rows, dtype=np.int64),
            seed,
            shuffle,
            val_fraction,
            chunked=False,
        )

    @property
    def num_train_rows(self) -> int:
        return int(self.unit_size[self.train_units].sum())

    def unit_rows(self, units: np.ndarray) -> np.ndarray:
        """Row ids of `units`, unit after unit, each in stored order."""
        if len(units) == 0:
            return np.zeros(0, dtype=np.int64)
        first = self.unit_start[units]
        rows, _ = _expand(first, first + self.unit_size[units] - 1)
        return rows

    def val_rows(self, rank: int, world: int) -> np.ndarray:
        """Rank `rank`'s share of the validation rows (whole units with `chunks`), sorted."""
        share = np.array_split(self.val_units, world)[rank]
        return np.sort(self.unit_rows(share))

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(training units in epoch order, where each one ends in the epoch's positions)."""
        if self._cached is None or self._cached[0] != epoch:
            units = self.train_units
            if self.shuffle:
                units = units[np.random.default_rng([self.seed, epoch]).permutation(len(units))]
            if self.shuffle and self.chunked and len(units):
                # units of the common size first, the odd ones (a file's last row group) at the
                # end: one odd unit early would shift every later window off the row-group
                # boundaries, and each rank would read one row group more per window
                sizes = self.unit_size[units]
                values, counts = np.unique(sizes, return_counts=True)
                units = units[np.argsort(sizes != values[counts.argmax()], kind="stable")]
            self._cached = (epoch, units, np.cumsum(self.unit_size[units]))
        return self._cached[1], self._cached[2]

    def _locate(self, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(index in the epoch's unit order, offset inside that unit) of each position."""
        _, ends = self._epoch(epoch)
        index = np.searchsorted(ends, positions, side="right")
        if len(positions) and index[-1] >= len(ends):
            raise IndexError(f"position {positions.max()} outside an epoch of {ends[-1]} rows")
        units, _ = self._epoch(epoch)
        return index, positions - (ends[index] - self.unit_size[units[index]])

    def row_ids(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Row ids at `positions` (ascending) of epoch `epoch`'s order."""
        positions = np.asarray(positions, dtype=np.int64)
        units, _ = self._epoch(epoch)
        index, within = self._locate(epoch, positions)
        unit = units[index]
        if self.chunked and self.shuffle and len(positions):
            # positions ascend, so each unit's positions are one run
            bounds = np.flatnonzero(np.diff(index)) + 1
            for lo, hi in zip(
                np.concatenate([[0], bounds]), np.concatenate([bounds, [len(index)]]), strict=True
            ):
                u = int(unit[lo])
                inner = np.random.default_rng([self.seed, epoch, u]).permutation(
                    int(self.unit_size[u])
                )
                within[lo:hi] = inner[within[lo:hi]]
        return self.unit_start[unit] + within

    def units_of(self, epoch: int, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The units that the position ranges [lo_k, hi_k) (ascending, non-empty) draw from, in
        the order they are first needed, and the last k that needs each."""
        units, _ = self._epoch(epoch)
        first, _ = self._locate(epoch, np.asarray(lo, dtype=np.int64))
        last, _ = self._locate(epoch, np.asarray(hi, dtype=np.int64) - 1)
        index, owner = _expand(first, last)
        # a unit's positions are contiguous: its entries are adjacent
        keep = np.concatenate([[True], np.diff(index) != 0]) if len(index) else index.astype(bool)
        ends = np.concatenate([np.flatnonzero(keep)[1:] - 1, [len(index) - 1]])
        return units[index[keep]], owner[ends] if len(index) else owner
