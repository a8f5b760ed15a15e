"""The worker's side of `batch.schedule` (config/batch_schedule.py): the phase a window runs
in, and the move to the next one at the first window starting at or past its sample — the
phase's split and LR (reached over a resize's re-warmup), said as an event, the windows laid
out anew from the sample reached and the reader's stream re-planned for them."""

from __future__ import annotations

from rayacc.config.batch_split import BatchSplit
from rayacc.observe.events import BatchPhaseChanged
from rayacc.run.quantities import EpochWindows
from rayacc.run.spec import RunSpec
from rayacc.worker.setup import REWARM_STEPS

__all__ = ["BatchPhases"]


class BatchPhases:
    """The phase of one group of `world` workers (without a schedule, phase 0 throughout)."""

    def __init__(self, spec: RunSpec, world: int):
        self.spec, self.world, self.phase = spec, world, 0

    def at(self, state) -> tuple[BatchSplit, float]:
        """The split and effective LR of the phase `state` (a TrainState) is in, made the
        group's phase (where a restored run starts)."""
        self.phase = self.spec.phase_at(state.samples_seen)
        return self.spec.split_at(self.world, self.phase), self.spec.lr_at(self.world, self.phase)

    def next_windows(self, run) -> list[EpochWindows]:
        """The windows after the last ones laid out (`run`: the WorkerRun): the next phase's
        where the run reached it — its split and LR taken, said — or the same phase's where an
        epoch's end came first; the reader's stream re-planned for them."""
        state, old = run.state, run.split
        if self.spec.phase_at(state.samples_seen) != self.phase:
            split, run.lr = self.at(state)
            run.sizer.set_split(split)
            run.schedule.set_peak(run.lr, rewarm_steps=REWARM_STEPS)
            run.outbox.send(
                BatchPhaseChanged(
                    step=state.optimizer_step,
                    samples=state.samples_seen,
                    old_global_batch_size=old.global_batch_size,
                    new_global_batch_size=split.global_batch_size,
                    old_grad_accum_steps=old.grad_accum_steps,
                    new_grad_accum_steps=split.grad_accum_steps,
                    effective_lr=run.lr,
                )
            )
        epochs = self.spec.epochs_from(state, run.split, run.data_rank)
        run.reader.restart([run.reader.epoch_reads(e.epoch, e.lo, e.hi) for e in epochs])
        return epochs

    def last_step(self, state, split: BatchSplit, epochs: list[EpochWindows]) -> int:
        """The run's last step from `state`: where `epochs` end, or where the phases do."""
        left = self.spec.steps_left(state, split.data_parallel)
        return state.optimizer_step + (sum(e.steps for e in epochs) if left is None else left)
