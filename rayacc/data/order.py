"""The data order in global-sample units (docs/design.md), in plain numpy.

Each epoch has one seeded order of all training rows. Optimizer step s of the epoch consumes
positions [s·G, (s+1)·G) of that order; rank r takes its contiguous share of the window and
splits it into micro-batches. The order depends on the seed and the epoch only, so any
(workers, micro, accum) with the same G sees the same samples at every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["EpochLayout", "RankWindow", "epoch_order", "split_train_val"]


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
        return self.leftover_rows

    @property
    def dropped_rows(self) -> int:
        return self.leftover_rows - self.short_window_rows

    @property
    def steps_per_epoch(self) -> int:
        return self.full_windows + (1 if self.short_window_rows else 0)

    def describe(self) -> str:
        text = (
            f"{self.num_rows} training rows = {self.full_windows} windows of "
            f"{self.global_batch_size}"
        )
        if self.leftover_rows == 0:
            return text
        if self.short_window_rows:
            return (
                text
                + f" + a short last window of {self.short_window_rows} rows (last_window=short)"
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
            per_rank = self.global_batch_size // w
            lo = start + rank * per_rank
            positions = np.arange(lo, lo + per_rank)
            parts = [
                positions[i : i + self.micro_batch_size]
                for i in range(0, per_rank, self.micro_batch_size)
            ]
            return RankWindow(step_in_epoch, parts, self.global_batch_size)
        rows = self.short_window_rows
        base, extra = divmod(rows, w)
        lo = start + rank * base + min(rank, extra)
        positions = np.arange(lo, lo + base + (1 if rank < extra else 0))
        # the same number of micro-steps on every rank, whatever its share of the short window
        k = max(1, math.ceil(base / self.micro_batch_size))
        return RankWindow(step_in_epoch, list(np.array_split(positions, k)), rows)

    def rank_positions(
        self, first_step: int, rank: int, stop_step: int | None = None
    ) -> np.ndarray:
        """Every position rank `rank` consumes in steps [first_step, stop_step) of the epoch."""
        stop = self.steps_per_epoch if stop_step is None else min(stop_step, self.steps_per_epoch)
        parts = [
            p for s in range(first_step, stop) for p in self.rank_window(s, rank).micro_batches
        ]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
