"""The windows a rank runs, in order, and what lays them out anew within a group: the next
phase of `batch.schedule` (config/batch_schedule.py) at the first window starting at or past
its sample, or where `auto` follows the gradient noise scale — its split and LR (reached over
a resize's re-warmup) — and new shares of `batch.balance: auto` (worker/balance.py); each said
as an event, the windows laid out again from the sample reached and the reader's stream
re-planned for them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from rayacc.config.batch_schedule import FOLLOW_EVERY
from rayacc.config.batch_split import BatchSplit
from rayacc.data.order import EpochLayout
from rayacc.observe.events import BatchPhaseChanged, SharesChanged
from rayacc.run.quantities import EpochWindows
from rayacc.run.spec import RunSpec
from rayacc.worker.balance import ShareBalancer
from rayacc.worker.setup import REWARM_STEPS

__all__ = ["BatchPhases"]


class BatchPhases:
    """The phase of one group of `world` workers (without a schedule, phase 0 throughout)."""

    def __init__(self, spec: RunSpec, world: int):
        self.spec, self.world, self.phase = spec, world, 0
        self.balancer = ShareBalancer() if spec.worker.balance else None
        self.noise_scale: float | None = None
        """The noise scale `auto` last moved by."""

    def windows(self, run) -> Iterator[tuple[int, EpochLayout, int]]:
        """(epoch, its layout, window) of each window `run` (the WorkerRun) runs next, from its
        `epochs` on; after each, the shares may move, and where the windows laid out end
        before the run does (a phase's sample reached), the next are laid out. A restored
        group first decides what the run decided after its checkpoint's window (`_follow`'s
        inputs are the checkpoint's: its state and noise scale)."""
        if self._follow(run):
            run.epochs = self.next_windows(run)
        while run.epochs:
            moved = False
            for ep in run.epochs:
                if ep.epoch != run.state.epoch:
                    run.state.start_epoch(ep.epoch)
                run.clock.restart()
                for s in range(ep.steps):
                    yield ep.epoch, ep.layout, s
                    balanced, followed = self._balance(run, ep.layout, s), self._follow(run)
                    if moved := balanced or followed:
                        break
                if moved:
                    break
            run.epochs = self.next_windows(run) if moved or self.spec.phases else []

    def _balance(self, run, layout: EpochLayout, s: int) -> bool:
        """Whether the shares moved after window `s` of `layout` (each rank's rows of it, and
        every rank's figures of the window before it, measured)."""
        if self.balancer is None:
            return False
        rows = [sum(map(len, layout.rank_window(s, r).micro_batches)) for r in range(
            layout.num_workers)]  # fmt: skip
        self.balancer.window(rows, run.telemetry.group_figures, run.telemetry.owners)
        split = run.split
        decided = self.balancer.decide(split.rank_shares, split.micro_batch_size)
        if decided is None:
            return False
        new, why = decided
        steps = -(-max(new) // split.micro_batch_size)
        run.sizer.set_split(replace(split, shares=new, grad_accum_steps=steps))
        run.outbox.send(SharesChanged(run.state.optimizer_step, split.rank_shares, new, why))
        return True

    def _follow(self, run) -> bool:
        """`batch.schedule: auto`: whether the global batch moves after this window — doubled
        while the smoothed noise scale is at least twice it, halved while under half (a
        negative estimate by `NoiseScale.move`'s rule), at most once in `FOLLOW_EVERY`
        windows. Every rank holds the same estimate: all decide alike."""
        state, value = run.state, run.telemetry.noise.value
        # a group that measures none (one rank) holds its batch: no decision on a stale value
        if not self.spec.auto or value is None or run.accumulate.noise_probe is None:
            return False
        if state.optimizer_step - state.batch_phase_step < FOLLOW_EVERY:
            return False
        move = run.telemetry.noise.move(run.split.global_batch_size)
        if move == 0 or not self.spec.has_phase(state.batch_phase + move):
            return False
        state.batch_phase += move
        state.batch_phase_step, self.noise_scale = state.optimizer_step, value
        return True

    def at(self, state) -> tuple[BatchSplit, float]:
        """The split and effective LR of the phase `state` (a TrainState) is in, made the
        group's phase (where a restored run starts)."""
        self.phase = self.spec.phase_of(state)
        return self.spec.split_at(self.world, self.phase), self.spec.lr_at(self.world, self.phase)

    def next_windows(self, run) -> list[EpochWindows]:
        """The windows after the last ones laid out (`run`: the WorkerRun): the next phase's
        where the run reached it — its split and LR taken, said — or the same phase's where an
        epoch's end came first; the reader's stream re-planned for them."""
        state, old = run.state, run.split
        changed = self.spec.phase_of(state) != self.phase
        if changed:
            split, run.lr = self.at(state)
            if self.balancer is not None:
                self.balancer.reset()
            run.sizer.set_split(split)
            run.schedule.set_peak(run.lr, rewarm_steps=REWARM_STEPS)
        epochs = self.spec.epochs_from(state, run.split, run.data_rank)
        run.reader.restart([run.reader.epoch_reads(e.epoch, e.lo, e.hi) for e in epochs])
        if self.spec.auto:  # the run's length at the batch it now runs
            run.cadence = replace(run.cadence, last_step=self.last_step(state, run.split, epochs))
            run.watch.cadence = run.cadence
        if changed:
            run.outbox.send(
                BatchPhaseChanged(
                    step=state.optimizer_step,
                    samples=state.samples_seen,
                    old_global_batch_size=old.global_batch_size,
                    new_global_batch_size=run.split.global_batch_size,
                    old_grad_accum_steps=old.grad_accum_steps,
                    new_grad_accum_steps=run.split.grad_accum_steps,
                    effective_lr=run.lr,
                    noise_scale=self.noise_scale if self.spec.auto else None,
                    total_steps=run.cadence.last_step if self.spec.auto else None,
                )
            )
        return epochs

    def last_step(self, state, split: BatchSplit, epochs: list[EpochWindows]) -> int:
        """The run's last step from `state`: where `epochs` end, or where the phases do."""
        left = self.spec.steps_left(state, split.data_parallel)
        return state.optimizer_step + (sum(e.steps for e in epochs) if left is None else left)
