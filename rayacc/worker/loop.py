"""The worker run: one DDP rank of the Ray Train worker group.

`train_loop` (Ray Train's `train_loop_per_worker`) builds a :class:`WorkerRun` and calls
`train()`, which reads top to bottom: restore → split the epochs → fetch this rank's rows →
(auto micro-batch) → window after window (fetch → step → record → validate → checkpoint).
The data order, the normalisation rule and the checkpoint contract are in docs/design.md.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import psutil
import ray
import ray.train
import torch
from ray.train.torch import get_device

from rayacc.checkpoint.format import checkpoint_meta
from rayacc.checkpoint.lineage import StepLog
from rayacc.data.order import EpochLayout
from rayacc.data.rows import LocalRows
from rayacc.data.sources import RowGroups
from rayacc.data.vocab import VOCAB_FILE
from rayacc.engine import (
    StepClock,
    TrainState,
    all_gather_objects,
    device_peak_tflops,
    flops_per_item,
    recompute_flops_per_item,
    to_device,
)
from rayacc.models.parallel import build_rank
from rayacc.observe.events import (
    Checkpointed,
    Event,
    PreemptionNotice,
    ReclaimStandby,
    Resized,
    RunStarted,
    ScheduleChanged,
)
from rayacc.observe.ranks import FIGURES_KEY, rank_report
from rayacc.optim import build_schedule
from rayacc.quantities import RunSpec, epoch_layout, rank_seed, remaining_epochs
from rayacc.worker.autosize import MicroBatchSizer
from rayacc.worker.checkpoint import Checkpointer, WorkerParts
from rayacc.worker.ingest import RankReader, warm_up
from rayacc.worker.metrics import run_summary, step_record
from rayacc.worker.preemption import Boundaries, PreemptionWatch, ray_notice_sources
from rayacc.worker.progress import Outbox
from rayacc.worker.system import NAMES as SYSTEM_NAMES
from rayacc.worker.system import NodeSampler, ResidentMemory
from rayacc.worker.validation import Validator

__all__ = ["REWARM_STEPS", "WorkerInputs", "WorkerRun", "train_loop"]

REWARM_STEPS = 5
"""Applied steps over which the LR moves to a new peak after a resize that changed it."""


@dataclass(frozen=True)
class WorkerInputs:
    """What the driver hands every rank of the worker group: the run, derived once, and where
    this fit reads, writes and reports."""

    spec: RunSpec
    source: str
    """Where the ranks read the data (a bundled file staged under the run's storage)."""
    groups: RowGroups
    """The source's row groups there."""
    storage: str
    name: str
    """The run's storage path and name (its folder: storage/name)."""
    progress: Any
    """The fit's ProgressBuffer actor (worker/progress.py); None where nothing listens."""
    vocabulary: str | None = None
    """A token run's vocabulary (JSON), kept by every checkpoint (`rayacc sample` decodes
    with it)."""
    lease: str | None = None
    """The token of the driver's lease on the run: a checkpoint is committed only while the
    lease is still that driver's (checkpoint/lease.py)."""


def train_loop(inputs: WorkerInputs) -> dict[str, Any]:
    """Ray Train's train_loop_per_worker (bound to its inputs): the run of this rank; rank
    0's return value is the fit's summary."""
    return WorkerRun(inputs).train()


class WorkerRun:
    """Everything one rank holds for its run. The LR schedule is laid out for the run's
    reference split, at the most workers; `split` is the split at the worker count of this
    group. How the model is spread over the ranks is the strategy's (engine/parallel/)."""

    def __init__(self, inputs: WorkerInputs):
        # when this process started and when its run began: bench/startup.py's worker phases
        self.resident = ResidentMemory()
        self.timeline = {"process_started": psutil.Process().create_time(), "entered": time.time()}
        self.spec = spec = inputs.spec
        self.cfg = cfg = spec.cfg
        self.info = spec.info
        self.read_in_process = 0 < self.info.data_bytes <= cfg.data.in_process_read_max_mb * 2**20
        if not self.read_in_process:
            warm_up()
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.progress = inputs.progress
        self.outbox = Outbox(self.progress if self.rank == 0 else None)
        self.device = self._device()
        # dropout and anything else random: one stream per rank, the same in every run
        torch.manual_seed(rank_seed(cfg.seed, self.rank))
        self.reference = spec.reference
        self.lr = spec.lr_at(self.world)
        self.sizer = MicroBatchSizer(cfg, spec.split_at(self.world), self.device, self.progress)
        self.groups = inputs.groups
        self.storage, self.name, self.lease = inputs.storage, inputs.name, inputs.lease
        self.source = inputs.source
        vocabulary = inputs.vocabulary
        self.checkpoint_files = {VOCAB_FILE: vocabulary} if vocabulary else {}
        self.order = spec.order
        self.state = TrainState()
        self.clock = StepClock()
        self.last: dict[str, Any] = {}
        self.val_metrics: dict[str, float] = {}
        self.resumed_from: int | None = None
        self.restore_s = 0.0
        self.flops_per_item: float | None = None
        self.recompute_flops = 0.0
        self.checkpoint_step: int | None = None
        """The step of the newest checkpoint this group restored or wrote."""
        self.window_signals = (0, 0.0)
        """The last window's signal count and wall time (worker/preemption.py)."""
        self.rank_report: list[float] = []
        """This rank's figures of its last window, sent with the next (observe/ranks.py)."""
        self.rank_figures: tuple[float, ...] = ()
        """Every rank's figures of the window before, as the last reduction brought them:
        handed to the driver with the step's record, which judges them there."""
        self.nodes: list[str] = []
        """Every rank's node, in rank order."""
        self.node_sampler: NodeSampler | None = None
        """With tracking.system_metrics: this node's figures (sampled by its first rank)."""
        quiet = (lambda: None), (lambda: None), None
        local, agree, end_now = (
            ray_notice_sources() if cfg.train.checkpoint_on_preemption else quiet
        )
        self.watch = PreemptionWatch(local, agree, end_now=end_now)
        self._build()
        self.timeline["built"] = time.time()

    @property
    def split(self):
        return self.sizer.split

    # ------------------------------------------------------------------ the run
    def train(self) -> dict[str, Any]:
        events = self._restore()
        self._plan_epochs()
        self.total_steps = self.state.optimizer_step + sum(e.steps for e in self.epochs)
        self.watch.boundaries = Boundaries(
            self.total_steps,
            self.cfg.train.val_every_steps,
            self.cfg.train.checkpoint_every_steps,
            validates=bool(len(self.order.val_units)),
        )
        self._open_data()
        if self.cfg.batch.auto_micro_batch and self.epochs:
            step = self.state.optimizer_step
            events.append(self.sizer.search(self.strategy, self.loss_fn, self.first_rows, step))
            self._plan_epochs()
            self.validate.batch_size = 2 * self.split.micro_batch_size
        self._gather_nodes()
        self._announce(events)
        for ep in self.epochs:
            self._begin_epoch(ep.epoch)
            for s in range(ep.steps):
                self._after_window(self._window(ep.epoch, ep.layout, s))
        self.outbox.flush()
        return self._summary()

    # ------------------------------------------------------------------ build and restore
    def _device(self) -> torch.device:
        # one intra-op thread per reserved CPU: more oversubscribes the cores other ranks use
        torch.set_num_threads(max(1, int(self.cfg.scaling.cpus_per_worker)))
        device = get_device()
        if self.cfg.train.allow_tf32 and device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        return device

    def _build(self) -> None:
        cfg = self.cfg
        parts = build_rank(
            cfg,
            self.info,
            self.device,
            self.lr,
            # a CUDA out-of-memory error halves the micro-batch on all ranks (auto micro-batch)
            oom_retry=cfg.batch.auto_micro_batch and self.device.type == "cuda",
        )
        self.strategy, self.model, self.optimizer = parts.strategy, parts.model, parts.optimizer
        self.loss_fn, self.count, self.step = parts.loss_fn, parts.count, parts.step
        # the schedule advances by samples (see _window), not by the engine's scheduler hook
        self.schedule = build_schedule(
            cfg,
            self.optimizer,
            peak_lr=self.lr,
            reference_batch=self.reference.global_batch_size,
            total_steps=self.spec.schedule_length,
        )
        self.peak_tflops = device_peak_tflops(
            self.device, cfg.train.peak_tflops, cfg.train.precision, cfg.train.allow_tf32
        )
        # the run's lineage of step records: rank 0's, carried by every checkpoint
        self.history = StepLog() if self.rank == 0 else None
        parts = WorkerParts(
            self.strategy,
            self.optimizer,
            {"schedule": self.schedule, "scaler": self.step.scaler, "train_state": self.state},
            rank=self.rank,
            world=self.world,
            device=self.device,
            seed=cfg.seed,
            history=self.history,
        )
        self.checkpoints = Checkpointer(self.storage, self.name, parts, lease=self.lease)

    def _restore(self) -> list[Event]:
        """Loads the latest checkpoint of the run, if any; a resize event when it was written
        at another worker count. (Whether it may be resumed at all was checked before launch.)"""
        t = time.perf_counter()
        meta = self.checkpoints.restore()
        if meta is None:
            return []
        self.restore_s = time.perf_counter() - t
        self.resumed_from = self.checkpoint_step = self.state.optimizer_step
        # a new global batch (keep_micro_batch) moves to its LR over a short re-warmup
        self.schedule.set_peak(self.lr, rewarm_steps=REWARM_STEPS)
        events: list[Event] = []
        if self.schedule.replanned is not None:
            old, new, lr = self.schedule.replanned
            events.append(ScheduleChanged(self.state.optimizer_step, old, new, lr))
        if meta["num_workers"] == self.world:
            return events
        return [
            *events,
            Resized(
                step=self.state.optimizer_step,
                policy=self.cfg.scaling.on_resize,
                old_workers=meta["num_workers"],
                new_workers=self.world,
                old_grad_accum_steps=meta.get("grad_accum_steps"),
                new_grad_accum_steps=self.split.grad_accum_steps,
                old_global_batch_size=meta["global_batch_size"],
                new_global_batch_size=self.split.global_batch_size,
                effective_lr=self.lr,
            ),
        ]

    # ------------------------------------------------------------------ data
    def _plan_epochs(self) -> None:
        self.epochs = remaining_epochs(
            self.cfg, self.order.num_train_rows, self.state, self.split, self.rank
        )

    def _open_data(self) -> None:
        """Starts this rank's reads (worker/ingest.py), takes its validation rows and the rows
        it holds first (for the micro-batch search, and the spare row of lockstep forwards)."""
        self.reader = RankReader(
            self.info, self.groups, self.order, self.source, in_process=self.read_in_process
        )
        self.reader.start(
            [self.reader.epoch_reads(e.epoch, e.lo, e.hi) for e in self.epochs],
            self.order.val_rows(self.rank, self.world),
        )
        val_rows = self.reader.validation()
        # this rank's first window (kept by the reader for the step that follows)
        first = self.reader.window(self.epochs[0].epoch, 0) if self.epochs else val_rows
        self.first_rows: LocalRows = first if len(first) else val_rows
        spare = self.first_rows.take(np.arange(1)) if len(self.first_rows) else None
        self.validate = Validator(
            self.strategy,
            self.loss_fn,
            self.count,
            val_rows,
            spare=spare,
            device=self.device,
            precision=self.cfg.train.precision,
            batch_size=2 * self.split.micro_batch_size,
        )
        self.timeline["data"] = time.time()

    def _begin_epoch(self, epoch: int) -> None:
        if epoch != self.state.epoch:
            self.state.start_epoch(epoch)
        self.clock.restart()

    def _gather_nodes(self) -> None:
        """Every rank's node, gathered once per group (a straggler is named with its node)."""
        node = f"{ray.util.get_node_ip_address()}/{ray.get_runtime_context().get_node_id()[:8]}"
        self.nodes = all_gather_objects(node)
        if self.cfg.tracking.system_metrics:
            self.node_sampler = NodeSampler(samples=self.nodes.index(node) == self.rank)

    # ------------------------------------------------------------------ one window
    def _announce(self, events: list[Event]) -> None:
        first_layout = self.epochs[0].layout if self.epochs else None
        layout = first_layout or epoch_layout(self.cfg, self.order.num_train_rows, self.split)
        self.outbox.send(
            RunStarted(
                step=self.state.optimizer_step,
                total_steps=self.total_steps,
                resumed_from=self.resumed_from,
                layout=layout.describe(),
                split=asdict(self.split),
                effective_lr=self.lr,
                restore_s=self.restore_s,
                entered_at=self.timeline["entered"],
                nodes=tuple(self.nodes),
                node_figures=SYSTEM_NAMES if self.node_sampler is not None else (),
            )
        )
        for event in events:
            self.outbox.send(event)
        self.outbox.flush()

    def _window(self, epoch: int, layout: EpochLayout, s: int) -> dict[str, Any]:
        """Fetch this rank's micro-batches of window `s`, run the accumulation step, advance
        the schedule and the train state; returns the step's record."""
        t_data = time.perf_counter()
        sizes = [len(part) for part in layout.rank_window(s, self.rank).micro_batches]
        rows = self.reader.window(epoch, s)
        host = rows.take_split(np.arange(len(rows)), sizes)
        local_items = sum(self.count(mb) for mb in host)  # on the host: no GPU sync
        micro_batches = [to_device(mb, self.device, non_blocking=True) for mb in host]
        data_s = time.perf_counter() - t_data
        if self.flops_per_item is None and micro_batches:
            shape = tuple(next(iter(micro_batches[0].values())).shape[1:])
            model = self.strategy.unwrapped()
            self.flops_per_item = flops_per_item(model, shape) or 0.0
            self.recompute_flops = recompute_flops_per_item(model, shape)
        try:
            result = self.step(
                micro_batches,
                self.loss_fn,
                self.count,
                local_items=local_items,
                signal=self.watch.signal(self.state.optimizer_step),
                rank_report=self.rank_report,
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
        if "first_step" not in self.timeline:
            self.timeline["first_step"] = time.time()
        wall_s = self.clock.lap()
        self.window_signals = (result.signals, wall_s)
        rss_mb = self.resident.mb()
        record = step_record(
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
            rss_mb=rss_mb,
            flops_per_item=self.flops_per_item or None,
            recompute_flops_per_item=self.recompute_flops,
            peak_tflops=self.peak_tflops,
            token_items=self.info.format == "tokens",
        )
        self._rank_telemetry(result, data_s, rss_mb)
        return record

    def _rank_telemetry(self, result, data_s: float, rss_mb: float) -> None:
        """This rank's figures of the window, sent with the next one (this one's reduction
        has left); every rank's figures of the window before, kept for the hand-over of the
        step's record. The driver judges them (observe/relay.py::RankRelay): nothing of it
        costs the step."""
        self.rank_report = rank_report(
            step_s=result.step_time_s,
            sync_s=result.sync_time_s,
            optimizer_s=result.optimizer_time_s,
            data_s=data_s,
            host_mb=rss_mb,
            device_mb=result.peak_memory_mb,
        )
        if self.node_sampler is not None:
            self.rank_report += self.node_sampler.figures()
        self.rank_figures = result.rank_figures

    def _after_window(self, record: dict[str, Any]) -> None:
        """Validation and checkpoints when due; the record goes to the driver. Validation and
        checkpoints are not step time; handing the record over is."""
        step = self.state.optimizer_step
        is_last = step >= self.total_steps
        boundaries = self.watch.boundaries
        if boundaries.validates_at(step):
            with self.clock.paused():
                t = time.perf_counter()
                self.val_metrics = self.validate()
                self.watch.validation_s = time.perf_counter() - t
            record.update(self.val_metrics, **{"val/time_s": self.watch.validation_s})
        self.last = record
        if self.history is not None:
            self.history.append(record)
        handed = dict(record)
        if self.rank_figures:
            # the driver's alone: not in the lineage, whose lines every step would lengthen
            handed[FIGURES_KEY] = self.rank_figures
        self.outbox.send(handed)
        checkpointed = boundaries.checkpoints_at(step)
        if checkpointed:
            with self.clock.paused():
                self._checkpoint(record, "last" if is_last else "periodic")
        self._on_preemption(record, checkpointed, is_last)

    def _on_preemption(self, record: dict[str, Any], checkpointed: bool, is_last: bool) -> None:
        """A notice agreed at this window: checkpoint now (when one fits), or, near the
        deadline, the last checkpoint and a wait for the restart (worker/preemption.py)."""
        action = self.watch.after_window(*self.window_signals)
        if action is None:
            return
        step = self.state.optimizer_step
        with self.clock.paused():
            # a checkpoint still in flight is in storage before anything a notice asks for
            self.checkpoints.wait()
            if action == "last":
                if not checkpointed:
                    self._checkpoint(record, "before the reclaim")
                if is_last:
                    return  # the run is done: nothing to wait for
                # rank 0 alone: one request to Ray for the whole group
                kept_until_deadline = self.watch.end_group() if self.rank == 0 else None
                self.outbox.send(
                    ReclaimStandby(step, self.watch.seconds_left(), kept_until_deadline)
                )
                self.outbox.flush()
                self.watch.stand_by()
                return
            # the ranks' clocks and checkpoint times differ: rank 0's judgement holds for all
            too_short = all_gather_objects(not checkpointed and self.watch.too_short())[0]
            seconds_left = self.watch.seconds_left()
            checkpoint_s = None
            if too_short:
                self.watch.give_up()
            elif not checkpointed:
                checkpoint_s = self._checkpoint(record, "preemption notice")
            notice = self.watch.notice
            self.outbox.send(
                PreemptionNotice(
                    step=step,
                    nodes=notice.nodes,
                    ranks=notice.ranks,
                    seconds_left=seconds_left,
                    deadline_given=notice.deadline_given,
                    checkpoint_s=checkpoint_s,
                    checkpoint_step=self.checkpoint_step,
                    too_short=too_short,
                )
            )
            self.outbox.flush()

    def _checkpoint(self, record: dict[str, Any], reason: str) -> float:
        """Writes the checkpoint of this step; returns the seconds training waited for it. A
        periodic one (train.checkpoint_mode=async) is written while training goes on; the
        run's last one and those a reclaim asks for are waited for."""
        t = time.perf_counter()
        # records up to a checkpoint are never replayed after a restart: hand them over
        self.outbox.flush()
        self.checkpoints.save(
            dict(record),
            step=self.state.optimizer_step,
            description={
                "config": self.cfg.model_dump(mode="json"),
                "dataset": self.info.to_dict(),
            },
            meta=checkpoint_meta(
                self.spec.identity,
                self.split,
                self.state,
                self.world,
                sharded=self.strategy.writes_shards,
            ),
            files=self.checkpoint_files,
            background=self.cfg.train.checkpoint_mode == "async",
        )
        if reason != "periodic":
            self.checkpoints.wait()
        seconds = time.perf_counter() - t
        self.checkpoint_step = self.state.optimizer_step
        # what a checkpoint the ranks must wait for costs: the whole write, not the blocking part
        self.watch.checkpoint_s = max(seconds, self.checkpoints.complete_s or 0.0)
        self.outbox.send(Checkpointed(self.state.optimizer_step, seconds, reason))
        return seconds

    def _summary(self) -> dict[str, Any]:
        self.timeline["finished"] = time.time()
        return run_summary(
            metrics=self.last,
            val=self.val_metrics,
            state=self.state,
            split=self.split,
            effective_lr=self.lr,
            total_steps=self.total_steps,
            resumed_from=self.resumed_from,
            train_time_s=self.clock.total_s,
            log_time_s=self.outbox.cost_s,
            device=self.device,
            timeline=self.timeline,
            token_model=self.info.format == "tokens",
        )
