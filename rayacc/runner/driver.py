"""fit(cfg): check everything a user can get wrong (`prepare`), start Ray and check that the
cluster can hold the worker group, build and start the TorchTrainer, open the run's tracking
while the group starts, relay the workers' events and step records to the observers, and hand
back a FitResult.

A library call: it changes no process-wide setting (environment, loggers); the CLI does that.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayacc import env
from rayacc.batch_plan import BatchPlan
from rayacc.config import TrainConfig
from rayacc.data.order import DataOrder, EpochLayout
from rayacc.data.sources import DataError, DatasetInfo, RowGroups, describe_dataset, row_groups
from rayacc.engine.units import fsdp_blocks
from rayacc.events import RunObserver
from rayacc.models import build_on_meta
from rayacc.quantities import (
    data_order,
    epoch_layout,
    run_effective_lr,
    total_optimizer_steps,
)
from rayacc.runner.runs import RunLocation, locate_run

__all__ = [
    "FitResult",
    "Prepared",
    "RunLocation",
    "TrainingError",
    "ensure_ray",
    "fit",
    "locate_run",
    "prepare",
]

log = logging.getLogger("rayacc")


class TrainingError(RuntimeError):
    """The training job failed after it started (not a config mistake)."""


@dataclass
class FitResult:
    """What a finished fit leaves behind (docs/design.md)."""

    checkpoint_dir: str | None
    mlflow_run_id: str | None
    metrics: dict[str, Any]
    plan: BatchPlan
    effective_lr: float
    run_name: str
    storage_path: str
    tracking_uri: str | None
    summary: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    wall_time_s: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    """When each phase of the fit ended on the driver (time.time()); bench/startup.py reads
    these beside the workers' own timeline in `summary["timeline"]`."""


# ----------------------------------------------------------------------------- checks
@dataclass
class Prepared:
    """Everything checked on the driver before any worker starts."""

    cfg: TrainConfig
    info: DatasetInfo
    plan: BatchPlan
    effective_lr: float
    layout: EpochLayout
    total_steps: int
    num_parameters: int
    warnings: list[str]
    notes: list[str] = field(default_factory=list)
    groups: RowGroups | None = None
    """The source's Parquet row groups (the units data is read in)."""


def prepare(cfg: TrainConfig) -> Prepared:
    """Resolves data, batch plan, LR and model; raises DataError / ModelError / BatchPlanError
    (all ValueError) for user mistakes."""
    info = describe_dataset(cfg.data.source, cfg.data.cache_dir, cfg.data.seq_len)
    plan = cfg.batch_plan()
    model = build_on_meta(cfg, info)
    groups = row_groups(info.path)
    order = data_order(cfg, info, groups)
    if len(order.train_units) == 0:
        raise DataError(
            f"data.val_fraction={cfg.data.val_fraction} holds out all {len(groups)} row "
            f"group(s) of {info.path} (data.order=chunks holds out whole row groups). Fix: "
            "write the data with smaller row groups (`rayacc data prepare`), set "
            "data.order=rows, or lower data.val_fraction"
        )
    layout = epoch_layout(cfg, order.num_train_rows, plan)
    if layout.steps_per_epoch == 0:
        raise DataError(
            f"data.source {info.path} has {order.num_train_rows} training rows, fewer than one "
            f"global batch ({plan.global_batch_size}). Fix: lower batch.global_batch_size or "
            "data.val_fraction, or use more data"
        )
    reads = read_factor(order, layout) if order.chunked else None
    return Prepared(
        cfg,
        info,
        plan,
        run_effective_lr(cfg, plan),
        layout,
        total_optimizer_steps(cfg, layout),
        sum(p.numel() for p in model.parameters()),
        _warnings(cfg, layout, model, reads, groups),
        [_order_note(cfg, info, groups, reads), *_notes(cfg, plan)],
        groups,
    )


def read_factor(order: DataOrder, layout: EpochLayout) -> float:
    """Rows the cluster reads in the first epoch over rows trained on (data.order=chunks: a
    row group that two ranks' shares straddle is read by both)."""
    read = 0
    for rank in range(layout.num_workers):
        lo, hi = layout.rank_intervals(rank)
        units, _ = order.units_of(0, lo, hi)
        read += int(order.unit_size[units].sum())
    return read / max(1, layout.num_rows - layout.dropped_rows)


def _order_note(cfg: TrainConfig, info: DatasetInfo, groups: RowGroups, reads: float | None) -> str:
    mib = info.data_bytes / 2**20
    if reads is None:
        return (
            f"data order: rows (an exact per-row shuffle; every rank reads all {mib:.1f} MiB "
            "each epoch)"
        )
    return (
        f"data order: chunks ({len(groups)} row groups of about "
        f"{info.num_rows / len(groups):.0f} rows, {mib:.1f} MiB); the cluster reads "
        f"{reads:.2f}× the rows it trains on per epoch"
    )


def _warnings(
    cfg: TrainConfig, layout: EpochLayout, model, reads: float | None, groups: RowGroups
) -> list[str]:
    warnings = []
    if cfg.data.materialize is not None:
        warnings.append(
            "data.materialize no longer has an effect: every rank reads its rows through Ray "
            "Data (remove the setting)"
        )
    if reads is not None and reads > 1.25:
        share = layout.global_batch_size // layout.num_workers
        warnings.append(
            f"data.order=chunks reads each row {reads:.2f}× per epoch: row groups of about "
            f"{int(groups.size.mean())} rows are large against each rank's {share} rows per "
            f"window. Fix: rewrite the data with row groups of at most {max(1, share // 4)} "
            "rows (`rayacc data prepare ... --rows-per-group N`), or use data.order=rows for "
            "data that fits in memory"
        )
    by_epochs = cfg.train.epochs * layout.steps_per_epoch
    if cfg.train.max_steps and cfg.train.max_steps > by_epochs:
        warnings.append(
            f"train.max_steps={cfg.train.max_steps} exceeds train.epochs × steps per epoch = "
            f"{cfg.train.epochs} × {layout.steps_per_epoch}; stopping at {by_epochs} "
            "(raise train.epochs to run longer)"
        )
    if layout.dropped_rows:
        warnings.append(layout.describe())
    if cfg.train.activation_checkpointing != "none" and not fsdp_blocks(model):
        warnings.append(
            "train.activation_checkpointing is set but the model names no blocks (a `blocks` "
            "ModuleList or an `fsdp_blocks()` method): nothing is recomputed"
        )
    bn = batchnorm_layers(model)
    if bn:
        warnings.append(
            f"the model holds BatchNorm layers ({', '.join(bn[:3])}): their statistics come from "
            "each micro-batch, so accumulation is not equivalent to the big batch. Fix: use "
            "GroupNorm or LayerNorm"
        )
    return warnings


def _notes(cfg: TrainConfig, plan: BatchPlan) -> list[str]:
    notes = [cfg.elastic_summary()] if cfg.scaling.elastic else []
    if cfg.batch.auto_micro_batch:
        notes.append(
            f"micro-batch auto: the workers search the largest divisor of {plan.micro_batch_size} "
            "(one worker's share) that fits the memory budget; the line above shows that upper "
            "bound, the chosen size is printed when training starts"
        )
    return notes


def batchnorm_layers(model) -> list[str]:
    from torch import nn

    return [
        n or "<root>"
        for n, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]


# ----------------------------------------------------------------------------- Ray
def ensure_ray(cfg: TrainConfig) -> None:
    """Joins RAY_ADDRESS when set, else starts a local Ray sized for the job."""
    import os

    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level=logging.WARNING)
        return
    # Ray Data's read tasks need CPUs beside the workers' or ingestion starves and hangs
    workers_cpu = cfg.scaling.max_workers * cfg.scaling.cpus_per_worker
    num_cpus = max(os.cpu_count() or 2, math.ceil(workers_cpu) + 2)
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        object_store_memory=2 * 1024**3,
        logging_level=logging.WARNING,
        # workers report through rayacc's own records; RAYACC_VERBOSE=1 shows Ray's worker logs
        log_to_driver=env.verbose(),
        # no idle workers started ahead: Ray Train's actors carry a runtime env of their own
        # and never use them, and on a small machine they take the CPU the workers start on
        # (seconds off every start on 2 cores)
        _system_config={"prestart_worker_first_driver": False},
    )


def build_trainer(cfg: TrainConfig, prep: Prepared, loc: RunLocation, progress):
    """The TorchTrainer of the run; `progress` is the ProgressBuffer rank 0 reports to."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from rayacc.runner.worker import train_loop

    source, groups = _read_source(cfg, prep, loc)
    s = cfg.scaling
    return TorchTrainer(
        train_loop,
        train_loop_config={
            "cfg": cfg.model_dump(mode="json"),
            "dataset": prep.info.to_dict(),
            "source": source,
            "groups": groups,
            "progress": progress,
        },
        scaling_config=ScalingConfig(
            num_workers=tuple(s.num_workers) if s.elastic else s.num_workers,
            elastic_resize_monitor_interval_s=s.resize_interval_s,
            use_gpu=s.use_gpu,
            resources_per_worker={"CPU": s.cpus_per_worker, **s.extra_resources},
            placement_strategy=s.placement_strategy,
        ),
        run_config=RunConfig(
            name=loc.name,
            storage_path=loc.storage,
            failure_config=FailureConfig(max_failures=cfg.run.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.run.keep_checkpoints),
        ),
        # no datasets here: each rank reads its own row groups through Ray Data
        # (runner/ingest.py)
    )


class History(RunObserver):
    """The run's step records by step (a group restarted from a checkpoint replays steps
    already seen: the first record of a step is kept) and its events."""

    def __init__(self) -> None:
        self.by_step: dict[int, dict[str, Any]] = {}
        self.events: list[Any] = []
        self.first_item_at: float | None = None

    def on_event(self, event) -> None:
        self.first_item_at = self.first_item_at or time.time()
        self.events.append(event)

    def on_step(self, record: dict[str, Any]) -> None:
        self.by_step.setdefault(record["step"], record)

    def records(self) -> list[dict[str, Any]]:
        return [self.by_step[s] for s in sorted(self.by_step)]


def _relay(buffer, observers: Sequence[RunObserver]) -> None:
    import ray

    for item in ray.get(buffer.drain.remote()):
        for observer in observers:
            if isinstance(item, dict):
                observer.on_step(item)
            else:
                observer.on_event(item)


class TrainerRun:
    """`trainer.fit()` in a thread of its own, started at once, so that the driver can do
    other work while the worker group starts; `relay` then hands the workers' items to the
    observers every half second until the fit ends."""

    def __init__(self, trainer, buffer):
        self.buffer = buffer
        self.outcome: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._fit, args=(trainer,), name="rayacc-fit")
        self.thread.daemon = True
        self.thread.start()

    def _fit(self, trainer) -> None:
        try:
            self.outcome["result"] = trainer.fit()
        except BaseException as exc:  # handed to the caller's thread by relay()
            self.outcome["error"] = exc

    def relay(self, observers: Sequence[RunObserver]):
        """The Ray Train Result, or TrainingError."""
        while self.thread.is_alive():
            self.thread.join(0.5)
            _relay(self.buffer, observers)
        _relay(self.buffer, observers)
        if "error" in self.outcome:
            exc = self.outcome["error"]
            raise TrainingError(f"training failed: {exc}") from exc
        return self.outcome["result"]


def _read_source(cfg: TrainConfig, prep: Prepared, loc: RunLocation) -> tuple[str, RowGroups]:
    """Where the ranks' read tasks read the data, and its row groups there."""
    from rayacc.data.sources import BUNDLED
    from rayacc.runner.ingest import stage_file

    if cfg.data.source in BUNDLED:
        # prepared in this node's cache, which read tasks on other nodes cannot see
        shared = stage_file(prep.info.path, loc.storage)
        return shared, row_groups(shared)
    return prep.info.path, prep.groups


def _check_cluster(cfg: TrainConfig) -> None:
    """A worker group the cluster can never hold is a user error (Ray Train would wait
    forever); on a cluster that may grow (one rayacc did not start), a warning."""
    import os
    import sys

    import ray

    from rayacc.runner.resources import check_resources

    may_grow = bool(os.environ.get("RAY_ADDRESS"))
    warning = check_resources(cfg, ray.nodes(), may_grow)
    if warning:
        print(f"rayacc: warning: {warning}; waiting for the cluster to grow", file=sys.stderr)


def _progress_buffer():
    """On the driver's node: a worker node may leave mid-run (elastic runs), the driver may
    not."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rayacc.runner.progress import ProgressBuffer

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ProgressBuffer.options(scheduling_strategy=here).remote()


# ----------------------------------------------------------------------------- fit
def fit(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    observers: Sequence[RunObserver] = (),
    prepared: Prepared | None = None,
    parent_run_id: str | None = None,
    tags: dict[str, Any] | None = None,
    location: RunLocation | None = None,
) -> FitResult:
    """Runs the TorchTrainer for `cfg` and returns its FitResult.

    `resume=True` continues the run named `run.name` (or the latest run in the storage path) from
    its latest checkpoint. `observers` see every event and per-step record as it arrives.
    `parent_run_id` nests the MLflow run under a sweep's parent run; `tags` are added to it.
    `location`: `locate_run(cfg, resume)` when the caller checked it already.
    """
    t0 = time.perf_counter()
    phases = {"called": time.time()}
    prep = prepared or prepare(cfg)
    loc = location or locate_run(cfg, resume, prep.info)
    phases["checked"] = time.time()
    ensure_ray(cfg)
    _check_cluster(cfg)
    phases["ray_started"] = time.time()
    buffer = _progress_buffer()
    running = TrainerRun(build_trainer(cfg, prep, loc, buffer), buffer)
    phases["fit_started"] = time.time()
    # the MLflow store opens (seconds for a new sqlite file) while the worker group starts
    tracked = _open_tracking(cfg, prep, loc, resume, parent_run_id, tags, phases)
    loc.record(tracked.run_id if tracked else None, tracked.sink.tracking_uri if tracked else None)
    history = History()
    try:
        result = running.relay([history, *([tracked] if tracked else []), *observers])
    except TrainingError:
        if tracked is not None:
            tracked.close("FAILED")
        raise
    phases["trained"] = time.time()
    phases["first_item"] = history.first_item_at or math.nan
    summary = result.return_value or {}
    checkpoint_dir = result.checkpoint.path if result.checkpoint is not None else None
    records = history.records()
    if tracked is not None:
        png = (
            loc.run_dir / "loss_curve.png"
            if loc.local
            else Path.cwd() / f"{loc.name}_loss_curve.png"
        )
        tracked.close(
            "FINISHED",
            history=records,
            checkpoint_dir=checkpoint_dir,
            worker_nodes=summary.get("worker_nodes", []),
            loss_curve=png,
        )
    phases["tracking_closed"] = time.time()
    return FitResult(
        checkpoint_dir=checkpoint_dir,
        mlflow_run_id=tracked.run_id if tracked else None,
        metrics=summary.get("metrics", {}),
        # what the last worker group ran with (an auto micro-batch is known only there)
        plan=BatchPlan(**summary["plan"]) if summary.get("plan") else prep.plan,
        effective_lr=prep.effective_lr,
        run_name=loc.name,
        storage_path=loc.storage,
        tracking_uri=tracked.sink.tracking_uri if tracked else None,
        summary=summary,
        history=records,
        wall_time_s=time.perf_counter() - t0,
        phases=phases,
    )


def _open_tracking(cfg, prep: Prepared, loc: RunLocation, resume, parent_run_id, tags, phases):
    if not cfg.tracking.enabled:
        return None
    phases["tracking_started"] = time.time()
    # imported only when tracking is on: a machine without MLflow can still train
    from rayacc.tracking import RunIdentity, open_tracking

    identity = RunIdentity(
        name=loc.name,
        storage_path=loc.storage,
        plan=prep.plan,
        effective_lr=prep.effective_lr,
        data_layout=prep.layout.describe(),
        num_parameters=prep.num_parameters,
        previous_run_id=loc.previous.get("mlflow_run_id") if resume else None,
        parent_run_id=parent_run_id,
        tags=tags or {},
    )
    tracked = open_tracking(cfg, identity)
    phases["tracking_opened"] = time.time()
    return tracked
