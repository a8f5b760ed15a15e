"""Validation of a rank's held-out rows: the mean item loss (and accuracy) over the validation
rows of all ranks, with the forwards in lockstep when the strategy needs it."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from rayacc.data.rows import LocalRows
from rayacc.engine import Strategy, all_reduce, autocast, to_device
from rayacc.engine.losses import count_rows, split_rows, summed

__all__ = ["Validator"]


class Validator:
    """`spare`: a batch a rank without rows of its own for a forward runs beside the others
    when the strategy's forwards are collectives (its result is not counted). `batch_size`:
    rows per forward (twice the micro-batch: no activations are kept for backward)."""

    def __init__(
        self,
        strategy: Strategy,
        loss_fn: Callable,
        count: Callable,
        rows: LocalRows,
        *,
        spare: dict[str, torch.Tensor] | None,
        device: torch.device,
        precision: str,
        batch_size: int,
    ):
        self.strategy, self.loss_fn, self.count, self.rows = strategy, loss_fn, count, rows
        self.spare, self.device, self.precision = spare, device, precision
        self.batch_size = batch_size
        self.classification = rows.format == "classification"

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        # the eager module, no DDP forward: ranks may run different numbers of batches (and
        # validation shapes would make a compiled module recompile)
        inner = self.strategy.unwrapped()
        pipelined = self.strategy.contract.pipelined
        if pipelined and self.strategy.pipeline_window:  # a window's micro-batches at a time
            micro_steps, rows = self.strategy.pipeline_window
            self.batch_size = micro_steps * rows
        was_training = inner.training
        inner.eval()
        totals = torch.zeros(3, dtype=torch.float64)
        n_rows = len(self.rows)
        own = math.ceil(n_rows / self.batch_size)
        n_batches = self.strategy.agree_forwards(own)
        if n_batches > own and self.spare is None:
            raise RuntimeError(
                "this rank holds no rows to run the forwards its peers run in lockstep"
            )
        for b in range(n_batches):
            start = b * self.batch_size
            index = np.arange(start, min(start + self.batch_size, n_rows))
            mb = to_device(self.rows.take(index) if b < own else self.spare, self.device)
            with autocast(self.device.type, self.precision):
                # a pipeline: forwards through the stages, the last one holds the losses
                losses = self._through_pipeline(mb) if pipelined else self.loss_fn(inner, mb)
                if self.classification:
                    correct = inner(mb["features"]).argmax(-1) == mb["label"]
            if b < own and self.strategy.holds_loss:
                loss, counted = summed(losses)
                totals[0] += float(loss)
                totals[1] += self.count(mb) + counted
                totals[2] += float(correct.sum()) if self.classification else 0.0
        inner.train(was_training)
        # every rank of every stage: the ranks that hold no losses add zeros
        loss_sum, items, correct = all_reduce(totals).tolist()
        out = {"val/loss": loss_sum / items if items else math.nan}
        if self.classification:
            out["val/accuracy"] = correct / items if items else math.nan
        return out

    def _through_pipeline(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        """A batch as micro-batches through the pipeline's stages, forwards only: (its
        item-loss sum, the items the loss counted itself)."""
        rows = (self.strategy.pipeline_window or (2, -(-count_rows(batch) // 2)))[1]
        parts = [p for p in split_rows(batch, -(-count_rows(batch) // rows)) if count_rows(p)]
        sums, counted = self.strategy.run_pipeline(parts, self.loss_fn, train=False)
        return torch.tensor(math.fsum(sums), dtype=torch.float64), counted
