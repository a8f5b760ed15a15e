"""`batch.micro_batch_size: auto` in the worker: the search on real rows of this rank, and the
bookkeeping of out-of-memory errors across restarts of the worker group (the sizes recorded in
the fit's `ProgressBuffer`, which outlives them)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import ray
import torch

from rayacc.config.batch_split import BatchSplit
from rayacc.data.rows import LocalRows
from rayacc.engine import (
    StepResult,
    Strategy,
    TrialOutOfMemory,
    autocast_dtype,
    find_micro_batch_size,
    to_device,
)
from rayacc.observe.events import MicroBatchChanged
from rayacc.run.spec import WorkerSettings

__all__ = ["MicroBatchSizer"]


class MicroBatchSizer:
    """The micro-batch and accumulation running now (an out-of-memory retry cuts the planned
    ones), the search, and the sizes that ran out of memory."""

    def __init__(self, settings: WorkerSettings, split: BatchSplit, device: torch.device, progress):
        self.settings, self.device, self.progress = settings, device, progress
        self.splits = 1
        self.set_split(split)

    def set_split(self, split: BatchSplit) -> None:
        self.split = split
        self.micro_now, self.accum_now = split.micro_batch_size, split.grad_accum_steps

    def search(
        self, strategy: Strategy, loss_fn: Callable, rows: LocalRows, step: int
    ) -> MicroBatchChanged:
        """The largest micro-batch that fits, the same on all ranks, tried on `rows` (real rows
        of this rank, repeated up to its share). Runs on the eager module (a compiled one would
        recompile for every size tried); the model is left as it was found."""
        split, device = self.split, self.device
        share = split.samples_per_worker
        index = np.resize(np.arange(len(rows)), share)

        def make_batch(n: int):
            return to_device(rows.take(index[:n]), device)

        failed = ray.get(self.progress.out_of_memory_sizes.remote()) if self.progress else []
        below = min(failed) if failed else None
        with self._out_of_memory_recorded():
            found = find_micro_batch_size(
                strategy.unwrapped(),
                loss_fn,
                make_batch,
                samples_per_worker=share,
                budget_bytes=self._budget_bytes(),
                autocast_dtype=autocast_dtype(self.settings.precision),
                optimizer_slots=self.settings.optimizer_slots,
                below=below,
                strategy=strategy,
            )
        self.set_split(
            replace(
                split,
                micro_batch_size=found.micro_batch_size,
                grad_accum_steps=found.grad_accum_steps,
            )
        )
        return MicroBatchChanged(
            step=step,
            micro_batch_size=self.split.micro_batch_size,
            grad_accum_steps=self.split.grad_accum_steps,
            reason="auto search"
            + (f", below {below} (out of memory in training before)" if below else ""),
            budget_mb=found.budget_bytes / 2**20,
            trials=tuple(tuple(t) for t in found.trials),
            out_of_memory=found.out_of_memory,
        )

    def _budget_bytes(self) -> int:
        if self.settings.memory_budget_mb is not None:
            return int(self.settings.memory_budget_mb * 2**20)
        total = torch.cuda.get_device_properties(self.device).total_memory
        return int(self.settings.memory_budget * total)

    @contextlib.contextmanager
    def _out_of_memory_recorded(self):
        """A sharded model's search trial that ran out of memory fails the group (see
        engine/autobatch.py); its size is recorded first, so the next search stays below."""
        try:
            yield
        except TrialOutOfMemory as exc:
            self.remember_out_of_memory(exc.micro_batch_size)
            raise

    def remember_out_of_memory(self, size: int | None = None) -> None:
        """An out-of-memory error the step could not recover from (in a window's last
        micro-step, where peers already wait in the gradient all-reduce, or without retries):
        the group fails and restarts from the checkpoint, and its auto search then stays below
        this size instead of choosing it again."""
        if self.settings.auto_micro_batch and self.progress is not None:
            # waited for: the process is about to fail
            ray.get(self.progress.remember_out_of_memory.remote(size or self.micro_now), timeout=30)

    def note_splits(self, result: StepResult, step: int) -> MicroBatchChanged | None:
        """An out-of-memory retry cut the micro-batches: the event to say so, once."""
        if result.micro_batch_splits == self.splits:
            return None
        self.splits = result.micro_batch_splits
        self.micro_now = math.ceil(self.split.micro_batch_size / self.splits)
        self.accum_now = self.split.grad_accum_steps * self.splits
        return MicroBatchChanged(
            step=step,
            micro_batch_size=self.micro_now,
            grad_accum_steps=self.accum_now,
            reason="out of memory",
        )
