"""The worker run: one DDP rank of the Ray Train worker group.

`train_loop` (Ray Train's `train_loop_per_worker`) builds a :class:`WorkerRun` and calls
`train()`, which reads top to bottom: restore → split the epochs → open this rank's rows →
(auto micro-batch) → window after window (fetch → step → record, then what the cadence asks:
validate, checkpoint; then what a reclaim notice decides). Set-up: worker/setup.py; the rest:
docs/design.md.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import numpy as np
import psutil
import ray.train
import torch

from rayacc.checkpoint.format import checkpoint_meta
from rayacc.data.order import EpochLayout
from rayacc.engine import StepClock, to_device
from rayacc.observe.events import Checkpointed, Event, RunStarted
from rayacc.run.quantities import rank_seed
from rayacc.worker.autosize import MicroBatchSizer
from rayacc.worker.cadence import Cadence
from rayacc.worker.ingest import warm_up
from rayacc.worker.metrics import run_summary
from rayacc.worker.phases import BatchPhases
from rayacc.worker.preemption import PreemptionWatch, Reclaim, ray_notice_sources
from rayacc.worker.progress import Outbox
from rayacc.worker.setup import (
    WorkerInputs,
    checkpoint_files,
    open_data,
    pick_device,
    restore,
    say_what_starts,
    set_up,
)
from rayacc.worker.system import NAMES as SYSTEM_NAMES
from rayacc.worker.telemetry import Telemetry

__all__ = ["WorkerInputs", "WorkerRun", "train_loop"]


def train_loop(inputs: WorkerInputs) -> dict[str, Any]:
    """Ray Train's train_loop_per_worker (bound to its inputs): the run of this rank; rank
    0's return value is the fit's summary."""
    return WorkerRun(inputs).train()


class WorkerRun:
    """One rank's run. The LR schedule is laid out for the run's reference split, at the most
    workers; `split` is the split at the worker count of this group. How the model is spread
    over the ranks is the strategy's (engine/parallel/)."""

    def __init__(self, inputs: WorkerInputs):
        # when this process started and when its run began: bench/startup.py's worker phases
        self.timeline = {"process_started": psutil.Process().create_time(), "entered": time.time()}
        self.inputs, self.spec = inputs, inputs.spec
        self.settings = settings = self.spec.worker
        if not settings.read_in_process:
            warm_up()
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.outbox = Outbox(inputs.progress if self.rank == 0 else None)
        self.device = pick_device(settings)
        # dropout and anything else random: one stream per rank, the same in every run
        torch.manual_seed(rank_seed(settings.seed, self.rank))
        self.lr = self.spec.lr_at(self.world)
        self.phases = BatchPhases(self.spec, self.world)
        split = self.spec.split_at(self.world)
        self.sizer = MicroBatchSizer(settings, split, self.device, inputs.progress)
        say_what_starts(settings.strategy, self.outbox)
        self.setup = set_up(self.spec, inputs, self.device, self.lr, self.rank, self.world)
        parts = self.setup.parts
        self.strategy, self.accumulate = parts.strategy, parts.accumulate
        self.loss_fn, self.count, self.data_rank = parts.loss_fn, parts.count, self.setup.data_rank
        self.state, self.schedule = self.setup.state, self.setup.schedule
        self.checkpoints = self.setup.checkpoints
        self.telemetry = Telemetry(
            self.rank, self.setup, token_items=self.spec.info.format == "tokens"
        )
        self.clock = StepClock()
        self.last: dict[str, Any] = {}
        self.val_metrics: dict[str, float] = {}
        self.checkpoint_step: int | None = None
        """The step of the newest checkpoint this group restored or wrote."""
        quiet = (lambda: None), (lambda: None), None
        local, agree, end_now = ray_notice_sources() if settings.checkpoint_on_preemption else quiet
        cost = self.checkpoints.cost_s
        self.watch = PreemptionWatch(local, agree, end_now=end_now, checkpoint_cost=cost)
        self.reclaim = Reclaim(
            self.watch,
            rank=self.rank,
            checkpoint=self._checkpoint,
            wait=self.checkpoints.wait,
            outbox=self.outbox,
        )
        self.timeline["built"] = time.time()

    @property
    def split(self):
        return self.sizer.split

    # ------------------------------------------------------------------ the run
    def train(self) -> dict[str, Any]:
        restored = restore(
            self.setup,
            world=self.world,
            at=self.phases.at,
            on_resize=self.settings.on_resize,
            balanced=self.settings.balance,
        )
        self.checkpoint_step, events, self.lr = restored.step, restored.events, restored.lr
        self.sizer.set_split(restored.split)
        self.epochs = self.spec.epochs_from(self.state, self.split, self.data_rank)
        self.cadence = Cadence(
            last_step=self.phases.last_step(self.state, self.split, self.epochs),
            val_every=self.settings.val_every_steps,
            checkpoint_every=self.settings.checkpoint_every_steps,
            validates=bool(len(self.spec.order.val_units)),
        )
        self.watch.cadence = self.cadence
        self.reader, first_rows, self.validate = open_data(
            self.spec,
            self.inputs,
            self.setup,
            self.epochs,
            self.device,
            rank=self.data_rank,
            world=self.split.data_parallel,
            batch_size=2 * self.split.micro_batch_size,
        )
        self.timeline["data"] = time.time()
        if self.settings.auto_micro_batch and self.epochs:
            step = self.state.optimizer_step
            events.append(self.sizer.search(self.strategy, self.loss_fn, first_rows, step))
            self.epochs = self.spec.epochs_from(self.state, self.split, self.data_rank)
            self.validate.batch_size = 2 * self.split.micro_batch_size
        self.telemetry.gather_nodes(self.settings.system_metrics)
        self._announce(restored, events)
        for epoch, layout, s in self.phases.windows(self):
            self._after_window(self._window(epoch, layout, s))
        self.outbox.flush()
        return self._summary(restored)

    # ------------------------------------------------------------------ one window
    def _announce(self, restored, events: list[Event]) -> None:
        layout = self.epochs[0].layout if self.epochs else self.spec.layout_at(self.split)
        self.outbox.send(
            RunStarted(
                step=self.state.optimizer_step,
                total_steps=self.cadence.last_step,
                resumed_from=restored.step,
                layout=layout.describe(),
                split=asdict(self.split),
                effective_lr=self.lr,
                restore_s=restored.seconds,
                entered_at=self.timeline["entered"],
                process_started_at=self.timeline["process_started"],
                nodes=self.telemetry.nodes,
                node_figures=SYSTEM_NAMES if self.telemetry.node_sampler is not None else (),
                mesh=self.strategy.describe_mesh(),
                places=self.telemetry.places,
                announced_at=time.time(),
            )
        )
        for event in events:
            self.outbox.send(event)
        self.outbox.flush()

    def _window(self, epoch: int, layout: EpochLayout, s: int) -> dict[str, Any]:
        """Fetch this rank's micro-batches of window `s`, run the accumulation step, advance
        the schedule and the train state; returns the step's record."""
        t_data = time.perf_counter()
        sizes = [len(part) for part in layout.rank_window(s, self.data_rank).micro_batches]
        rows = self.reader.window(epoch, s)
        host = rows.take_split(np.arange(len(rows)), sizes)
        local_items = [self.count(mb) for mb in host]  # on the host: no GPU sync
        micro_batches = [to_device(mb, self.device, non_blocking=True) for mb in host]
        data_s = time.perf_counter() - t_data
        self.telemetry.count_flops(self.strategy, micro_batches)
        try:
            result = self.accumulate(
                micro_batches,
                self.loss_fn,
                self.count,
                local_items=local_items,
                signal=self.watch.signal(self.state.optimizer_step),
                figures=self.telemetry.figures,
            )
        except torch.OutOfMemoryError:
            self.sizer.remember_out_of_memory()
            raise
        changed = self.sizer.note_splits(result, self.state.optimizer_step)
        if changed is not None:
            self.outbox.send(changed)
        if not result.skipped:
            self.schedule.step(result.samples)
        self.state.advance(samples=result.samples, items=result.items, skipped=result.skipped)
        if s == layout.steps_per_epoch - 1:
            self.state.start_epoch(epoch + 1)
        self.timeline.setdefault("first_step", time.time())
        wall_s = self.clock.lap()
        self.window_signals = (result.signals, wall_s)
        return self.telemetry.record(
            result,
            step=self.state.optimizer_step,
            epoch=epoch,
            wall_s=wall_s,
            data_s=data_s,
            split=self.split,
            micro_now=self.sizer.micro_now,
            accum_now=self.sizer.accum_now,
            skipped_steps=self.state.skipped_steps,
            rows_read=self.reader.rows_read,
        )

    def _after_window(self, record: dict[str, Any]) -> None:
        """What the cadence asks at this boundary, and what a reclaim notice decides; the
        record goes to the driver. Validation and checkpoints are not step time; handing the
        record over is."""
        step = self.state.optimizer_step
        cadence = self.cadence
        if cadence.should_validate(step):
            with self.clock.paused():
                t = time.perf_counter()
                self.val_metrics = self.validate()
                self.watch.validation_s = time.perf_counter() - t
            record.update(self.val_metrics, **{"val/time_s": self.watch.validation_s})
        self.last = record
        if self.setup.history is not None:
            self.setup.history.append(record)
        self.outbox.send(self.telemetry.handed(record))
        checkpointed = cadence.should_checkpoint(step)
        if checkpointed:
            with self.clock.paused():
                self._checkpoint("last" if cadence.is_last(step) else "periodic")
        decision = self.watch.after_window(*self.window_signals)
        if decision is not None:
            with self.clock.paused():
                self.reclaim.carry_out(
                    decision,
                    step,
                    checkpointed=checkpointed,
                    is_last=cadence.is_last(step),
                    last_saved=lambda: self.checkpoint_step,
                )

    def _checkpoint(self, reason: str) -> float:
        """Writes the checkpoint of this step; returns the seconds training waited for it (an
        async periodic one is written while training goes on; the last and a reclaim's not)."""
        t = time.perf_counter()
        # records up to a checkpoint are never replayed after a restart: hand them over
        self.outbox.flush()
        self.telemetry.settle_noise()  # the smoothing the checkpoint keeps has this window's
        step = self.state.optimizer_step
        waited = self.checkpoints.save(
            dict(self.last),
            step=step,
            description=self.spec.description,
            meta=checkpoint_meta(
                self.spec.identity,
                self.split,
                self.state,
                self.world,
                shards=self.strategy.state.folder,
                state_format=self.strategy.state.name,
            ),
            files=checkpoint_files(self.inputs.vocabulary),
            background=self.settings.checkpoint_mode == "async",
        )
        if reason != "periodic":
            self.checkpoints.wait()
        seconds = time.perf_counter() - t
        self.checkpoint_step, self.watch.blocking_s = step, seconds
        self.outbox.send(Checkpointed(step, seconds, reason, waited_s=waited))
        return seconds

    def _summary(self, restored) -> dict[str, Any]:
        self.timeline["finished"] = time.time()
        return run_summary(
            metrics=self.last,
            val=self.val_metrics,
            state=self.state,
            split=self.split,
            effective_lr=self.lr,
            total_steps=self.cadence.last_step,
            resumed_from=restored.step,
            train_time_s=self.clock.total_s,
            log_time_s=self.outbox.cost_s,
            device=self.device,
            timeline=self.timeline,
            token_model=self.spec.info.format == "tokens",
            worker_nodes=self.telemetry.node_ids,
        )
