"""fit(cfg): validate everything a user can get wrong, then launch the TorchTrainer, relay
per-step records to the console and MLflow, and hand back a FitResult."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayacc.batch_plan import BatchPlan
from rayacc.config import TrainConfig
from rayacc.data.order import EpochLayout, split_train_val
from rayacc.data.sources import DataError, DatasetInfo, describe_dataset
from rayacc.engine.lr import effective_lr
from rayacc.models import build_model

__all__ = ["FitResult", "Prepared", "TrainingError", "ensure_ray", "fit", "prepare"]

log = logging.getLogger("rayacc")
RUN_INFO = "rayacc_run.json"
LATEST = "LATEST"


class TrainingError(RuntimeError):
    """The training job failed after it started (not a config mistake)."""


@dataclass
class FitResult:
    """What a finished fit leaves behind (design.md)."""

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


def prepare(cfg: TrainConfig) -> Prepared:
    """Resolves data, batch plan, LR and model; raises DataError / ModelError / BatchPlanError
    (all ValueError) for user mistakes."""
    info = describe_dataset(cfg.data.source, cfg.data.cache_dir, cfg.data.seq_len)
    plan = cfg.batch_plan()
    lr = effective_lr(
        cfg.optim.lr, plan.global_batch_size, cfg.optim.base_batch_size, cfg.optim.lr_scaling
    )
    model = build_model(cfg, info)
    train_ids, _ = split_train_val(info.num_rows, cfg.data.val_fraction, cfg.seed)
    layout = EpochLayout(
        len(train_ids),
        plan.global_batch_size,
        plan.micro_batch_size,
        plan.num_workers,
        cfg.data.last_window,
    )
    if layout.steps_per_epoch == 0:
        raise DataError(
            f"data.source {info.path} has {len(train_ids)} training rows, fewer than one global "
            f"batch ({plan.global_batch_size}). Fix: lower batch.global_batch_size or "
            "data.val_fraction, or use more data"
        )
    warnings = []
    by_epochs = cfg.train.epochs * layout.steps_per_epoch
    total = by_epochs
    if cfg.train.max_steps:
        total = min(cfg.train.max_steps, by_epochs)
        if cfg.train.max_steps > by_epochs:
            warnings.append(
                f"train.max_steps={cfg.train.max_steps} exceeds train.epochs × steps per epoch = "
                f"{cfg.train.epochs} × {layout.steps_per_epoch}; stopping at {by_epochs} "
                "(raise train.epochs to run longer)"
            )
    if layout.dropped_rows:
        warnings.append(layout.describe())
    notes = [cfg.elastic_summary()] if cfg.scaling.elastic else []
    if cfg.batch.auto_micro_batch:
        notes.append(
            f"micro-batch auto: the workers search the largest divisor of {plan.micro_batch_size} "
            "(one worker's share) that fits the memory budget; the line above shows that upper "
            "bound, the chosen size is printed when training starts"
        )
    bn = batchnorm_layers(model)
    if bn:
        warnings.append(
            f"the model holds BatchNorm layers ({', '.join(bn[:3])}): their statistics come from "
            "each micro-batch, so accumulation is not equivalent to the big batch. Fix: use "
            "GroupNorm or LayerNorm"
        )
    return Prepared(
        cfg,
        info,
        plan,
        lr,
        layout,
        total,
        sum(p.numel() for p in model.parameters()),
        warnings,
        notes,
    )


def batchnorm_layers(model) -> list[str]:
    from torch import nn

    return [
        n or "<root>"
        for n, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]


def ensure_ray(cfg: TrainConfig) -> None:
    """Joins RAY_ADDRESS when set, else starts a local Ray sized for the job."""
    import ray

    if ray.is_initialized():
        return
    # worker prints would otherwise reach the driver twice
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
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
        log_to_driver=os.environ.get("RAYACC_VERBOSE") == "1",
    )


def _storage(cfg: TrainConfig) -> str:
    path = cfg.run.storage_path or str(Path.cwd() / "rayacc_runs")
    if "://" in path:
        return path
    return str(Path(path).expanduser().resolve())


def _run_name(cfg: TrainConfig, storage: str, resume: bool) -> str:
    if cfg.run.name:
        return cfg.run.name
    if resume:
        latest = Path(storage) / LATEST
        if "://" in storage or not latest.is_file():
            raise DataError(
                f"--resume: no previous run recorded in {storage}. "
                "Fix: set run.name to the run to resume"
            )
        return latest.read_text().strip()
    return f"rayacc-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def _loss_curve_png(history: list[dict[str, Any]], path: Path) -> bool:
    points = [
        (r["step"], r["train/loss"])
        for r in history
        if "train/loss" in r and math.isfinite(r["train/loss"])
    ]
    if not points:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*points), label="train/loss")
    val = [(r["step"], r["val/loss"]) for r in history if "val/loss" in r]
    if val:
        ax.plot(*zip(*val), "o-", label="val/loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean item loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def fit(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    prepared: Prepared | None = None,
    parent_run_id: str | None = None,
    tags: dict[str, Any] | None = None,
) -> FitResult:
    """Runs the TorchTrainer for `cfg` and returns its FitResult.

    `resume=True` continues the run named `run.name` (or the latest run in the storage path) from
    its latest checkpoint. `on_record` sees every per-step record and event as it arrives.
    `parent_run_id` nests the MLflow run under a sweep's parent run; `tags` are added to it.
    """
    import ray
    from ray.data import ExecutionOptions
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from rayacc.runner.progress import ProgressBuffer
    from rayacc.runner.worker import train_loop

    t0 = time.perf_counter()
    prep = prepared or prepare(cfg)
    storage = _storage(cfg)
    name = _run_name(cfg, storage, resume)
    run_dir = Path(storage) / name
    local_storage = "://" not in storage
    previous: dict[str, Any] = {}
    if resume and local_storage and (run_dir / RUN_INFO).is_file():
        previous = json.loads((run_dir / RUN_INFO).read_text())

    sink = None
    tracking_uri = None
    if cfg.tracking.enabled:
        # imported only when tracking is on: a machine without MLflow can still train
        from rayacc.tracking import MlflowSink, contract_params, default_tracking_uri

        tracking_uri = cfg.tracking.tracking_uri or default_tracking_uri()
        sink = MlflowSink(
            tracking_uri,
            cfg.tracking.experiment,
            cfg.tracking.run_name or name,
            run_id=previous.get("mlflow_run_id") if resume else None,
            parent_run_id=parent_run_id,
        )
        if sink.active and not (resume and previous.get("mlflow_run_id")):
            params = contract_params(cfg, prep.plan, prep.effective_lr)
            if cfg.batch.auto_micro_batch:
                # known once the workers have searched: logged from their event
                del params["micro_batch_size"], params["grad_accum_steps"]
            sink.log_params(params)
            sink.log_text(cfg.to_yaml(), "config.yaml")
            sink.set_tags(
                {
                    "rayacc.run_name": name,
                    "rayacc.storage_path": storage,
                    "rayacc.data_layout": prep.layout.describe(),
                    "rayacc.num_parameters": prep.num_parameters,
                    **(tags or {}),
                }
            )
    if local_storage:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / RUN_INFO).write_text(
            json.dumps(
                {"mlflow_run_id": sink.run_id if sink else None, "tracking_uri": tracking_uri}
            )
        )
        (Path(storage) / LATEST).write_text(name)

    ensure_ray(cfg)
    # on the driver's node: a worker node may leave mid-run (elastic runs), the driver may not
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    buffer = ProgressBuffer.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False)
    ).remote()
    if os.environ.get("RAYACC_VERBOSE") != "1":
        # Ray Data reports each execution on the driver's console; rayacc shows its own progress
        logging.getLogger("ray.data").setLevel(logging.ERROR)
        ray.data.DataContext.get_current().enable_progress_bars = False
    ds = ray.data.read_parquet(prep.info.path)
    # a row's position in the stream is its row id: the order must not depend on task timing
    ds.context.execution_options = ExecutionOptions(preserve_order=True)
    if cfg.data.materialize:
        # one read on the driver instead of one per rank per start: seconds saved at every start
        ds = ds.materialize()
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={
            "cfg": cfg.model_dump(mode="json"),
            "dataset": prep.info.to_dict(),
            "progress": buffer,
        },
        scaling_config=ScalingConfig(
            num_workers=tuple(cfg.scaling.num_workers)
            if cfg.scaling.elastic
            else cfg.scaling.num_workers,
            elastic_resize_monitor_interval_s=cfg.scaling.resize_interval_s,
            use_gpu=cfg.scaling.use_gpu,
            resources_per_worker={
                "CPU": cfg.scaling.cpus_per_worker,
                **cfg.scaling.extra_resources,
            },
            placement_strategy=cfg.scaling.placement_strategy,
        ),
        run_config=RunConfig(
            name=name,
            storage_path=storage,
            failure_config=FailureConfig(max_failures=cfg.run.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=cfg.run.keep_checkpoints),
        ),
        datasets={"train": ds},
        # unsplit: each rank picks its rows by the global order (rayacc.runner.ingest)
        dataset_config=DataConfig(
            datasets_to_split=[], execution_options=ExecutionOptions(preserve_order=True)
        ),
    )

    history: dict[int, dict[str, Any]] = {}
    events: list[dict[str, Any]] = []
    resumed_at: list[str] = []
    resizes: list[str] = []
    micro_changes: list[str] = []

    def relay() -> None:
        for record in ray.get(buffer.drain.remote()):
            if "event" in record:
                events.append(record)
                if record["event"] == "resize":
                    resizes.append(
                        f"step {record['step']}: workers {record['old_workers']}→"
                        f"{record['new_workers']}, accum {record['old_grad_accum_steps']}→"
                        f"{record['new_grad_accum_steps']}, global "
                        f"{record['old_global_batch_size']}→{record['new_global_batch_size']}"
                    )
                    if sink is not None:
                        sink.set_tags({"rayacc.resizes": "; ".join(resizes)})
                if record["event"] == "micro_batch":
                    micro_changes.append(
                        f"step {record['step']}: micro {record['micro_batch_size']} × accum "
                        f"{record['grad_accum_steps']} ({record['reason']})"
                    )
                    if sink is not None:
                        if len(micro_changes) == 1 and not previous.get("mlflow_run_id"):
                            sink.log_params(
                                {
                                    "micro_batch_size": record["micro_batch_size"],
                                    "grad_accum_steps": record["grad_accum_steps"],
                                }
                            )
                        sink.set_tags({"rayacc.micro_batch_events": "; ".join(micro_changes)})
                if record["event"] == "start" and record.get("resumed_from") is not None:
                    resumed_at.append(str(record["resumed_from"]))
                    if sink is not None:
                        sink.set_tags({"rayacc.resumed_at_steps": ",".join(resumed_at)})
            else:
                # a group restarted from a checkpoint replays steps already seen: keep the first
                history.setdefault(record["step"], record)
                if sink is not None:
                    sink.log_step_metrics([record])
            if on_record is not None:
                on_record(record)

    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # handed to the caller's thread below
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="rayacc-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
        relay()
    relay()

    records = [history[s] for s in sorted(history)]
    if "error" in outcome:
        if sink is not None:
            sink.finish("FAILED")
        exc = outcome["error"]
        raise TrainingError(f"training failed: {exc}") from exc

    result = outcome["result"]
    summary = result.return_value or {}
    checkpoint_dir = result.checkpoint.path if result.checkpoint is not None else None
    if sink is not None:
        sink.set_tags(
            {
                "rayacc.checkpoint_dir": checkpoint_dir,
                "rayacc.worker_nodes": ",".join(summary.get("worker_nodes", [])),
            }
        )
        png = run_dir / "loss_curve.png" if local_storage else Path.cwd() / f"{name}_loss_curve.png"
        if _loss_curve_png(records, png):
            sink.log_artifact(png)
        sink.finish("FINISHED")
    return FitResult(
        checkpoint_dir=checkpoint_dir,
        mlflow_run_id=sink.run_id if sink else None,
        metrics=summary.get("metrics", {}),
        # what the last worker group ran with (an auto micro-batch is known only there)
        plan=BatchPlan(**summary["plan"]) if summary.get("plan") else prep.plan,
        effective_lr=prep.effective_lr,
        run_name=name,
        storage_path=storage,
        tracking_uri=tracking_uri,
        summary=summary,
        history=records,
        wall_time_s=time.perf_counter() - t0,
    )
