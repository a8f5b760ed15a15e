"""fit(cfg): check everything a user can get wrong (`prepare`), start Ray and check that the
cluster can hold the worker group, build and start the TorchTrainer, open the run's tracking
while the group starts, relay the workers' events and step records to the observers, and hand
back a FitResult.

A library call: it changes no process-wide setting (environment, loggers); the CLI does that.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rayacc import env
from rayacc.checkpoint.lease import RunLease
from rayacc.cluster import capacity
from rayacc.cluster.capacity import NodeWatch
from rayacc.config import TrainConfig
from rayacc.config.batch_split import BatchSplit
from rayacc.config.schema import ScalingConfig
from rayacc.data.sources import RowGroups
from rayacc.data.vocab import Vocabulary
from rayacc.driver.prelaunch import Prepared, check_cluster, locate, prepare
from rayacc.driver.ray_record import retain
from rayacc.driver.resume import run_to_fit
from rayacc.driver.runs import RunLocation
from rayacc.models.errors import ModelError
from rayacc.observe.events import RunObserver, RunStarted
from rayacc.observe.goodput import Goodput
from rayacc.observe.relay import FiguresRelay
from rayacc.redact import redact
from rayacc.worker.checkpoint import NoCheckpointLoads, raised_by_ranks

__all__ = [
    "FitResult",
    "Prepared",
    "RunLocation",
    "TrainingError",
    "ensure_ray",
    "fit",
    "locate",
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
    split: BatchSplit
    """How the global batch split (micro × accumulation × workers) in the last worker group."""
    effective_lr: float
    """The peak LR of the last worker group (its global batch's)."""
    run_name: str
    storage_path: str
    tracking_uri: str | None
    mlflow_experiment_id: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    wall_time_s: float = 0.0
    """From the call to the last step's arrival (the MLflow run's `rayacc.wall_time_s`)."""
    goodput: dict[str, float] = field(default_factory=dict)
    """Where the wall time went (rayacc/observe/goodput.py; the MLflow run's `goodput/…`)."""
    phases: dict[str, float] = field(default_factory=dict)
    """When each phase of the fit ended on the driver (time.time()); bench/startup.py reads
    these beside the workers' own timeline in `summary["timeline"]`."""

    @property
    def plan(self) -> BatchSplit:
        """The old name of `split` (kept for scripts that read it)."""
        return self.split

    def __repr__(self) -> str:
        # the history holds every step's record: a repr of it all would fill the screen
        m = self.metrics
        parts = [f"run_name={self.run_name!r}", f"steps={m.get('step', len(self.history))}"]
        names = {"train/loss": "train_loss", "val/loss": "val_loss", "val/accuracy": "val_acc"}
        for key, name in names.items():
            if isinstance(m.get(key), (int, float)):
                parts.append(f"{name}={m[key]:.4g}")
        parts += [
            f"global_batch={self.split.global_batch_size}",
            f"effective_lr={self.effective_lr:.4g}",
            f"wall_time_s={self.wall_time_s:.1f}",
            f"checkpoint_dir={self.checkpoint_dir!r}",
            f"mlflow_run_id={self.mlflow_run_id!r}",
            f"history=<{len(self.history)} step records>",
        ]
        return f"FitResult({', '.join(parts)})"


# ----------------------------------------------------------------------------- Ray
def ensure_ray(scaling: ScalingConfig) -> None:
    """Joins RAY_ADDRESS when set, else starts a local Ray sized for the job."""
    import os

    import ray

    if ray.is_initialized():
        return
    env.plain_ray_lines()
    if address := os.environ.get("RAY_ADDRESS"):
        from rayacc.driver.arguments import address_problem
        from rayacc.driver.places import PlaceError

        # the variable stands for --address (env.FLAG_VARIABLES): checked as the flag is
        if problem := address_problem(address):
            raise PlaceError([f"$RAY_ADDRESS (it stands for --address): {redact(problem)}"])
        # the workers' and Ray Train's log lines stay in the cluster's logs, as on a local Ray
        ray.init(
            logging_level=logging.WARNING,
            log_to_driver=env.verbose(),
            runtime_env={"env_vars": scaling.ray_train_env()},
        )
        return
    # Ray Data's read tasks need CPUs beside the workers' or ingestion starves and hangs
    workers_cpu = scaling.max_workers * scaling.cpus_per_worker
    num_cpus = max(os.cpu_count() or 2, math.ceil(workers_cpu) + 2)
    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        object_store_memory=2 * 1024**3,
        logging_level=logging.WARNING,
        # workers report through rayacc's own records; RAYACC_VERBOSE=1 shows Ray's worker logs
        log_to_driver=env.verbose(),
        # no idle workers ahead: Ray Train's actors (own runtime env) never use them, they take CPU
        _system_config={"prestart_worker_first_driver": False},
        runtime_env={"env_vars": scaling.ray_train_env()},
    )


def refresh_elastic_sizing(scaling: ScalingConfig) -> None:
    """An elastic group starts at the size Ray's autoscaling coordinator reserves for it, and
    that detached actor outlives runs and reads the cluster's nodes every 20 s: on a joined
    cluster a node that came within that time is missed, so the group would start smaller and
    grow at its first resize check, redoing every step before its first checkpoint. The
    coordinator reads them now. (A local Ray has all its nodes from the start.)"""
    import os

    if not (scaling.elastic and os.environ.get("RAY_ADDRESS")):
        return
    try:
        capacity.recount()
    except Exception as e:  # the group then starts at the size of the coordinator's last look
        log.warning(
            "rayacc: could not have Ray's autoscaling coordinator read the cluster's nodes "
            "before the elastic group starts (%s: %s); a node that joined in the last 20 s may "
            "be counted only at the first resize check",
            type(e).__name__,
            e,
        )


def build_trainer(prep: Prepared, loc: RunLocation, progress, lease: str | None = None):
    """The TorchTrainer of the run; `progress` is the ProgressBuffer rank 0 reports to;
    `lease`: the token of this driver's lease on the run."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from rayacc.worker.loop import WorkerInputs, train_loop

    source, groups = _read_source(prep, loc)
    vocabulary = Vocabulary.of_data(prep.info, prep.source_metadata)
    s, run = prep.spec.cfg.scaling, prep.spec.cfg.run
    inputs = WorkerInputs(
        spec=prep.spec,
        source=source,
        groups=groups,
        storage=loc.storage,
        name=loc.name,
        progress=progress,
        vocabulary=vocabulary.to_json() if vocabulary else None,
        lease=lease,
    )
    return TorchTrainer(
        functools.partial(train_loop, inputs),
        scaling_config=ScalingConfig(
            num_workers=tuple(s.num_workers) if s.elastic else s.num_workers,
            elastic_resize_monitor_interval_s=s.resize_interval_s,
            use_gpu=s.use_gpu,
            resources_per_worker=s.resources_per_worker(),
            placement_strategy=s.placement_strategy,
        ),
        run_config=RunConfig(
            name=loc.name,
            storage_path=loc.storage,
            failure_config=FailureConfig(max_failures=run.max_failures),
            # retention is rayacc's (`Checkpointer.prune`): a passed-over folder never counts
            checkpoint_config=CheckpointConfig(num_to_keep=None),
        ),
        # no datasets here: each rank reads its row groups through Ray Data (worker/ingest.py)
    )


class History(RunObserver):
    """The run's lineage of step records, by step, and this fit's events. A worker group that
    starts from the checkpoint at step C (a resume, a restart after a failure, a resize) drops
    the records after C (an attempt no checkpoint kept) and takes 1..C from the checkpoint
    where this fit has not seen them (`lineage`)."""

    def __init__(self, lineage=lambda step: ()) -> None:
        self.lineage = lineage
        self.by_step: dict[int, dict[str, Any]] = {}
        self.events: list[Any] = []
        self.first_item_at: float | None = None

    def on_event(self, event) -> None:
        self.first_item_at = self.first_item_at or time.time()
        self.events.append(event)
        if isinstance(event, RunStarted):
            kept = {s: r for s, r in self.by_step.items() if s <= event.step}
            if len(kept) < event.step:
                for record in self.lineage(event.step):
                    kept.setdefault(record["step"], record)
            self.by_step = kept

    def on_step(self, record: dict[str, Any]) -> None:
        self.by_step[record["step"]] = record

    def records(self) -> list[dict[str, Any]]:
        return [self.by_step[s] for s in sorted(self.by_step)]


def _relay(buffer, ranks: FiguresRelay, observers: Sequence[RunObserver]) -> None:
    import ray

    for handed in ray.get(buffer.drain.remote()):
        for item in ranks.admit(handed):
            for observer in observers:
                if isinstance(item, dict):
                    observer.on_step(item)
                else:
                    observer.on_event(item)


class TrainerRun:
    """`trainer.fit()` in a thread of its own, started at once, so that the driver can do
    other work while the worker group starts; `relay` then hands the workers' items to the
    observers every half second until the fit ends."""

    def __init__(self, trainer, buffer, ranks: FiguresRelay, lost=lambda: None, nodes=None):
        """`nodes`: an elastic run's NodeWatch, polled as items are relayed (a lost node is
        counted out of the next group's size at once)."""
        self.buffer, self.ranks, self.lost, self.nodes = buffer, ranks, lost, nodes
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
            _relay(self.buffer, self.ranks, observers)
            if self.nodes is not None:
                self.nodes.poll()
            if self.lost() is not None:
                # its workers commit nothing more (their lease check fails): end the fit here
                raise TrainingError(self.lost())
        _relay(self.buffer, self.ranks, observers)
        if "error" in self.outcome:
            exc = self.outcome["error"]
            if (mine := raised_by_ranks(exc, (NoCheckpointLoads, ModelError))) is not None:
                raise mine from None  # the user's, as a check on the driver would raise it
            raise TrainingError(f"training failed: {exc}") from exc
        return self.outcome["result"]


def _read_source(prep: Prepared, loc: RunLocation) -> tuple[str, RowGroups]:
    """Where the ranks' read tasks read the data, and its row groups there."""
    from rayacc.data.common import BUNDLED
    from rayacc.data.reads import filesystem_and_path, stage_file

    if prep.spec.cfg.data.source in BUNDLED:
        # prepared in this node's cache, which read tasks on other nodes cannot see
        shared = stage_file(prep.info.path, loc.storage)
        return shared, prep.groups.moved_to(filesystem_and_path(shared)[1])
    return prep.info.path, prep.groups


def _progress_buffer():
    """On the driver's node: a worker node may leave mid-run (elastic runs), the driver may
    not."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rayacc.worker.progress import ProgressBuffer

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
    `location`: `prelaunch.locate(run, resume, terms)` when the caller checked it already.
    """
    t0 = time.perf_counter()
    phases = {"called": time.time()}
    # from here on the run is read from its RunSpec (derived once, in `prepare`)
    prep, loc = run_to_fit(cfg, resume, prepared, location, say=log.warning)
    # one writer per run: refused while another live driver holds the run
    lease = RunLease(loc.storage, loc.name).take()
    try:
        return _fit_holding(
            prep,
            loc,
            resume,
            observers,
            parent_run_id,
            tags,
            phases=phases,
            t0=t0,
            lease=lease,
        )
    finally:
        lease.release()


def _fit_holding(
    prep: Prepared,
    loc: RunLocation,
    resume: bool,
    observers: Sequence[RunObserver],
    parent_run_id: str | None,
    tags: dict[str, Any] | None,
    *,
    phases: dict[str, float],
    t0: float,
    lease: RunLease | None = None,
) -> FitResult:
    cfg = prep.spec.cfg  # its sections, read (the run's quantities come from the RunSpec)
    phases["checked"] = time.time()
    ensure_ray(cfg.scaling)
    check_cluster(cfg.scaling, cfg.mesh)
    refresh_elastic_sizing(cfg.scaling)
    phases["ray_started"] = time.time()
    buffer = _progress_buffer()
    ranks = FiguresRelay(margin=cfg.train.straggler_margin)
    trainer = build_trainer(prep, loc, buffer, lease=lease.token if lease else None)
    nodes = None
    if cfg.scaling.elastic:
        # the ranks' own handling of a notice ends their group once its last checkpoint is
        # written, just before the deadline: the watch waits for the deadline then
        lead = 0.0 if cfg.train.checkpoint_on_preemption else capacity.LEAD_S
        nodes = NodeWatch(warn=lambda m: log.warning("rayacc: %s", m), lead_s=lead)
    running = TrainerRun(
        trainer, buffer, ranks, lost=lambda: lease.lost if lease else None, nodes=nodes
    )
    phases["fit_started"] = time.time()
    lineage = functools.lru_cache(maxsize=4)(loc.checkpoints.lineage)
    # the MLflow store opens (seconds for a new sqlite file) while the worker group starts
    tracked = _open_tracking(prep, loc, resume, parent_run_id, tags, phases, lineage)
    loc.record(
        mlflow_run_id=tracked.run_id if tracked else None,
        tracking_uri=tracked.sink.tracking_uri if tracked else None,
        job=cfg.source_file,
        model=cfg.model.name,
        data=cfg.data.source,  # the info file is written masked
        identity=prep.spec.identity,
        total_steps=prep.total_steps,
        status="running",
        kind="verify" if (tags or {}).get("rayacc.verify") else None,  # verify's one-step probe
        overrides=loc.overrides,
    )
    history = History(lineage)
    goodput = Goodput(started=phases["called"], checked=phases["checked"])
    try:
        result = running.relay([history, goodput, *([tracked] if tracked else []), *observers])
    except BaseException as exc:
        # every exit after the run opened ends it (a worker's error of any kind, Ctrl-C)
        status = tracked.ended_by(exc) if tracked is not None else "FAILED"
        loc.record(status=status.lower(), mlflow_run_id=tracked.run_id if tracked else None)
        raise
    phases["trained"] = time.time()
    retain(loc.storage, loc.name, cfg.run.keep_checkpoints)  # every rank's part is in storage
    # one measure of a fit's time, for the console, FitResult and the MLflow run alike
    wall_time_s = time.perf_counter() - t0
    split = goodput.split(wall_time_s)
    phases["first_item"] = history.first_item_at or math.nan
    summary = result.return_value or {}
    checkpoint_dir = result.checkpoint.path if result.checkpoint is not None else None
    records = history.records()
    if tracked is not None:
        from rayacc.tracking.run import run_model_reader

        png = (
            loc.run_dir / "loss_curve.png"
            if loc.local
            # off the working directory (often a checkout): a local copy, logged to MLflow
            else env.cache_dir() / "loss_curves" / f"{loc.name}.png"
        )
        tracked.close(
            "FINISHED",
            history=records,
            checkpoint_dir=checkpoint_dir,
            worker_nodes=summary.get("worker_nodes", []),
            loss_curve=png,
            wall_time_s=wall_time_s,
            goodput=split,
            model=cfg.model.name,
            weights=run_model_reader(cfg, checkpoint_dir) if checkpoint_dir else None,
        )
    phases["tracking_closed"] = time.time()
    loc.record(status="finished", mlflow_run_id=tracked.run_id if tracked else None)
    return FitResult(
        checkpoint_dir=checkpoint_dir,
        mlflow_run_id=tracked.run_id if tracked else None,
        metrics=summary.get("metrics", {}),
        # what the last worker group ran with (an auto micro-batch is known only there)
        split=BatchSplit(**summary["split"]) if summary.get("split") else prep.split,
        effective_lr=summary.get("effective_lr", prep.effective_lr),
        run_name=loc.name,
        storage_path=loc.storage,
        tracking_uri=tracked.sink.tracking_uri if tracked else None,
        mlflow_experiment_id=tracked.sink.experiment_id if tracked else None,
        summary=summary,
        history=records,
        wall_time_s=wall_time_s,
        goodput=split,
        phases=phases,
    )


def _open_tracking(prep: Prepared, loc: RunLocation, resume, parent_run_id, tags, phases, lineage):
    cfg = prep.spec.cfg
    if not cfg.tracking.enabled:
        return None
    phases["tracking_started"] = time.time()
    # imported only when tracking is on: a machine without MLflow can still train
    from rayacc.driver.resume import continued_run
    from rayacc.tracking import RunIdentity, open_tracking

    previous, continues = continued_run(loc.previous if resume else {}, cfg.tracking.tracking_uri)
    tags = {**(tags or {}), **prep.tags}
    if continues:
        tags["rayacc.continues"] = continues
        note = f"a new MLflow run continues run {continues} (tag rayacc.continues)"
        print(f"rayacc: --resume into another tracking store: {note}", file=sys.stderr)
    identity = RunIdentity(
        name=loc.name,
        storage_path=loc.storage,
        split=prep.split,
        effective_lr=prep.effective_lr,
        data_layout=prep.layout.describe(),
        num_parameters=prep.num_parameters,
        previous_run_id=previous,
        parent_run_id=parent_run_id,
        tags=tags,
        data=prep.info,
        train_rows=prep.spec.order.num_train_rows,
        record_files=prep.spec.record_files,
        lr_explanation=prep.spec.lr_explanation,
    )
    tracked = open_tracking(cfg, identity, lineage=lineage)
    phases["tracking_opened"] = time.time()
    return tracked
