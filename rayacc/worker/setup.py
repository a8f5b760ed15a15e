"""A rank's set-up before its first window: the device, the training parts (built once, by
`build_rank`, as the planner and `verify` build theirs), the LR schedule, the checkpointer
over them, and where a resumed run stands."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist
from ray.train.torch import get_device

from rayacc.checkpoint.lineage import StepLog
from rayacc.config.batch_split import BatchSplit
from rayacc.data.rows import LocalRows
from rayacc.data.sources import RowGroups
from rayacc.data.vocab import VOCAB_FILE
from rayacc.engine import SampleSchedule, TrainState, device_peak_tflops
from rayacc.engine.noise import NoiseScale
from rayacc.engine.parallel import strategy_class
from rayacc.engine.random_state import RandomStreams
from rayacc.observe.events import (
    CheckpointPassedOver,
    Event,
    GroupStarting,
    Resized,
    ScheduleChanged,
)
from rayacc.optim import build_schedule
from rayacc.rank.build import RankParts, build_rank
from rayacc.redact.origins import register_run
from rayacc.run.quantities import EpochWindows
from rayacc.run.spec import RunSpec, WorkerSettings
from rayacc.worker.checkpoint import Checkpointer, WorkerParts
from rayacc.worker.ingest import RankReader
from rayacc.worker.validation import Validator

__all__ = [
    "REWARM_STEPS",
    "RankSetup",
    "Restored",
    "WorkerInputs",
    "open_data",
    "pick_device",
    "restore",
    "say_what_starts",
    "set_up",
]

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


def pick_device(settings: WorkerSettings) -> torch.device:
    # one intra-op thread per reserved CPU: more oversubscribes the cores other ranks use
    torch.set_num_threads(max(1, int(settings.cpus_per_worker)))
    device = get_device()
    if settings.allow_tf32 and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return device


@dataclass
class RankSetup:
    """A rank's training parts and what keeps them."""

    parts: RankParts
    schedule: SampleSchedule
    """Advanced by samples (the loop's window), not by the engine's scheduler hook."""
    state: TrainState
    history: StepLog | None
    """The run's lineage of step records: rank 0's, carried by every checkpoint."""
    checkpoints: Checkpointer
    peak_tflops: float | None
    noise: NoiseScale
    """The gradient noise scale as logged (`grad/noise_scale`), kept by the checkpoints."""
    data_rank: int
    """The share of the data this rank reads: its data-parallel rank (a tensor-parallel group
    reads one share)."""


def set_up(
    spec: RunSpec, inputs: WorkerInputs, device: torch.device, lr: float, rank: int, world: int
) -> RankSetup:
    """The rank's parts at peak LR `lr`, the schedule and the checkpointer over them."""
    register_run(spec.cfg, streams=True)  # this process's sinks know the run's secrets first
    w = spec.worker
    parts = build_rank(
        spec.cfg,
        spec.info,
        device,
        lr,
        # a CUDA out-of-memory error halves the micro-batch on all ranks (auto micro-batch)
        oom_retry=w.auto_micro_batch and device.type == "cuda",
        split=spec.split_at(world),
        strategy_user=w.strategy_user,
        node=ray.get_runtime_context().get_node_id(),
    )
    schedule = build_schedule(
        spec.cfg.optim,
        parts.optimizer,
        peak_lr=lr,
        reference_batch=spec.reference.global_batch_size,
        total_steps=spec.schedule_length,
    )
    state = TrainState()
    noise = NoiseScale()
    history = StepLog() if rank == 0 else None
    group = parts.strategy.data_group
    data_rank = dist.get_rank(group) if group is not None else rank
    # one stream per rank of the counts' group: a tensor-parallel group's replicated
    # activations see the same dropout; a pipeline's stages each their own
    group = parts.strategy.process_group
    streams = RandomStreams(
        w.seed,
        dist.get_rank(group) if group is not None else rank,
        dist.get_world_size(group) if group is not None else world,
        device,
    )
    streams.start()
    kept = WorkerParts(
        parts.strategy,
        parts.optimizer,
        {
            "schedule": schedule,
            "scaler": parts.accumulate.scaler,
            "train_state": state,
            "noise_scale": noise,
        },
        rank=rank,
        world=world,
        device=device,
        streams=streams,
        history=history,
    )
    return RankSetup(
        parts=parts,
        schedule=schedule,
        state=state,
        history=history,
        checkpoints=Checkpointer(
            inputs.storage,
            inputs.name,
            kept,
            lease=inputs.lease,
            keep=spec.cfg.run.keep_checkpoints,
        ),
        peak_tflops=device_peak_tflops(device, w.peak_tflops, w.precision, w.allow_tf32),
        noise=noise,
        data_rank=data_rank,
    )


def checkpoint_files(vocabulary: str | None) -> dict[str, str]:
    """The files every checkpoint keeps besides the parts: a token run's vocabulary (`rayacc
    sample` decodes with it)."""
    return {VOCAB_FILE: vocabulary} if vocabulary else {}


@dataclass
class Restored:
    """Where a resumed run stands (nothing, for a new run)."""

    step: int | None = None
    """The step of the checkpoint restored."""
    seconds: float = 0.0
    events: list[Event] = field(default_factory=list)
    """A resize, when the checkpoint was written at another worker count; a replanned
    schedule."""
    split: BatchSplit | None = None
    lr: float = 0.0
    """The split and effective LR the group runs at from here (its phase's: `at`)."""


def restore(
    setup: RankSetup,
    *,
    world: int,
    at: Callable[[TrainState], tuple[BatchSplit, float]],
    on_resize: str,
    balanced: bool = False,
) -> Restored:
    """Loads the latest checkpoint of the run, if any (whether it may be resumed at all was
    checked before launch); `at`: the split and LR where the restored state stands;
    `balanced` (`batch.balance: auto`): the checkpoint's shares go on where they fit."""
    t = time.perf_counter()
    meta: dict[str, Any] | None = setup.checkpoints.restore()
    passed = [
        CheckpointPassedOver(note, meta and meta["optimizer_step"])
        for note in setup.checkpoints.passed_over
    ]
    split, lr = at(setup.state)
    if meta is None:
        return Restored(events=passed, split=split, lr=lr)
    shares = tuple(meta.get("shares") or ())
    if balanced and len(shares) == split.data_parallel and sum(shares) == split.global_batch_size:
        steps = -(-max(shares) // split.micro_batch_size)
        split = replace(split, shares=shares, grad_accum_steps=steps)
    step = setup.state.optimizer_step
    restored = Restored(step, time.perf_counter() - t, passed, split, lr)
    # a new global batch (keep_micro_batch) moves to its LR over a short re-warmup
    setup.schedule.set_peak(lr, rewarm_steps=REWARM_STEPS)
    if setup.schedule.replanned is not None:
        old, new, peak = setup.schedule.replanned
        restored.events.append(
            ScheduleChanged(step, old, new, peak, setup.schedule.reference_batch)
        )
    if meta["num_workers"] != world:
        restored.events.append(
            Resized(
                step=step,
                policy=on_resize,
                old_workers=meta["num_workers"],
                new_workers=world,
                old_grad_accum_steps=meta.get("grad_accum_steps"),
                new_grad_accum_steps=split.grad_accum_steps,
                old_global_batch_size=meta["global_batch_size"],
                new_global_batch_size=split.global_batch_size,
                effective_lr=lr,
                new_micro_batch_size=split.micro_batch_size,
                new_shares=split.shares,
            )
        )
    return restored


def open_data(
    spec: RunSpec,
    inputs: WorkerInputs,
    setup: RankSetup,
    epochs: list[EpochWindows],
    device: torch.device,
    *,
    rank: int,
    world: int,
    batch_size: int,
) -> tuple[RankReader, LocalRows, Validator]:
    """Starts this rank's reads (worker/ingest.py); returns the reader, the rows it holds first
    (for the micro-batch search, and the spare row of lockstep forwards) and the validation
    over this rank's validation rows."""
    reader = RankReader(
        spec.info, inputs.groups, spec.order, inputs.source, in_process=spec.worker.read_in_process
    )
    reader.start(
        [reader.epoch_reads(e.epoch, e.lo, e.hi) for e in epochs],
        spec.order.val_rows(rank, world),
    )
    val_rows = reader.validation()
    # this rank's first window (kept by the reader for the step that follows)
    first = reader.window(epochs[0].epoch, 0) if epochs else val_rows
    first_rows = first if len(first) else val_rows
    spare = first_rows.take(np.arange(1)) if len(first_rows) else None
    p = setup.parts
    validate = Validator(
        p.strategy,
        p.loss_fn,
        p.count,
        val_rows,
        spare=spare,
        device=device,
        precision=spec.worker.precision,
        batch_size=batch_size,
    )
    return reader, first_rows, validate


def say_what_starts(strategy: str, outbox) -> None:
    """Says, before the rank builds its parts, what the strategy's start spends long on."""
    starting = strategy_class(strategy).starting
    if starting:
        outbox.send(GroupStarting(starting))
        outbox.flush()
