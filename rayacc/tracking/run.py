"""The MLflow run of one fit: opened with its params and tags, fed as an observer of the run's
events and step records, closed with its outcome."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayacc.config import TrainConfig
from rayacc.config.batch_split import BatchSplit
from rayacc.data.sources import DatasetInfo
from rayacc.observe.events import (
    BatchPhaseChanged,
    CheckpointPassedOver,
    Event,
    MicroBatchChanged,
    PreemptionNotice,
    ReclaimStandby,
    Resized,
    RunObserver,
    RunStarted,
    ScheduleChanged,
    SharesChanged,
    Straggler,
)
from rayacc.tracking.history import DISCARDED_TAG, Discarded, discarded_marks, marks_tag
from rayacc.tracking.mlflow_sink import MlflowSink, tracking_target
from rayacc.tracking.params import contract_params
from rayacc.tracking.plots import loss_curve_png

__all__ = ["RunIdentity", "TrackedRun", "open_tracking"]


@dataclass(frozen=True)
class RunIdentity:
    """What the tracking record says about the run besides its config."""

    name: str
    storage_path: str
    split: BatchSplit
    effective_lr: float
    data_layout: str
    num_parameters: int
    previous_run_id: str | None = None
    """The MLflow run of an earlier attempt of this run (a resume continues it)."""
    parent_run_id: str | None = None
    tags: dict[str, Any] = field(default_factory=dict)
    data: DatasetInfo | None = None
    """The data the run trains on (its MLflow dataset input); `train_rows` of it train."""
    train_rows: int = 0
    record_files: dict[str, str] = field(default_factory=dict)
    """The strategy's files for the record (`RunSpec.record_files`: made from the driver's read
    of the user's file, which the workers got, not the file as it is later)."""
    lr_explanation: str = ""
    """How the effective LR follows from `optim.*` (`RunSpec.lr_explanation`)."""


Lineage = Callable[[int], Sequence[dict[str, Any]]]
"""The step records 1..step of the run's lineage, as the checkpoint at `step` holds them."""


class TrackedRun(RunObserver):
    """Writes the run's events as tags and its step records as metrics (rank 0's records only,
    on the driver), so that the run holds the lineage of its latest checkpoint: whenever a
    worker group starts from a checkpoint (a resume, a restart after a failure, a resize), the
    steps up to it that the store lacks are written from the checkpoint's records, and the
    points the run holds after it (an attempt that never reached a checkpoint) are marked
    discarded and logged anew as the group does them again (`tracking/history.py`)."""

    def __init__(
        self,
        sink: MlflowSink,
        reopened: bool,
        *,
        lineage: Lineage = lambda step: (),
    ):
        self.sink = sink
        self.reopened = reopened
        self.lineage = lineage
        # a reopened run's event tags are extended, not overwritten by this driver's events
        tags = sink.existing_tags
        self.resizes = _entries(tags.get("rayacc.resizes"), "; ")
        self.resumed_at = _entries(tags.get("rayacc.resumed_at_steps"), ",")
        self.micro_changes = _entries(tags.get("rayacc.micro_batch_events"), "; ")
        self.schedule_changes = _entries(tags.get("rayacc.schedule_changes"), "; ")
        self.batch_phases = _entries(tags.get("rayacc.batch_phases"), "; ")
        self.shares = _entries(tags.get("rayacc.shares"), "; ")
        self.preemptions = _entries(tags.get("rayacc.preemptions"), "; ")
        self.stragglers = _entries(tags.get("rayacc.stragglers"), "; ")
        self.passed_over = _entries(tags.get("rayacc.passed_over"), "; ")
        self.discarded = discarded_marks(tags)

    @property
    def run_id(self) -> str | None:
        return self.sink.run_id

    def on_event(self, event: Event) -> None:
        if isinstance(event, Resized):
            self.resizes.append(event.describe())
            self.sink.set_tags({"rayacc.resizes": "; ".join(self.resizes)})
        elif isinstance(event, MicroBatchChanged):
            self.micro_changes.append(event.describe())
            if len(self.micro_changes) == 1 and not self.reopened:
                # with micro_batch_size: auto these two params are known only now
                self.sink.log_params(
                    {
                        "micro_batch_size": event.micro_batch_size,
                        "grad_accum_steps": event.grad_accum_steps,
                    }
                )
            self.sink.set_tags({"rayacc.micro_batch_events": "; ".join(self.micro_changes)})
        elif isinstance(event, (PreemptionNotice, ReclaimStandby)):
            self.preemptions.append(event.describe())
            self.sink.set_tags({"rayacc.preemptions": "; ".join(self.preemptions)})
        elif isinstance(event, Straggler):
            self.stragglers.append(event.describe())
            self.sink.set_tags({"rayacc.stragglers": "; ".join(self.stragglers)})
        elif isinstance(event, CheckpointPassedOver):
            self.passed_over.append(event.describe())
            # a tag's value is at most 8,000 characters: the newest kept
            self.sink.set_tags({"rayacc.passed_over": "; ".join(self.passed_over)[-7000:]})
        elif isinstance(event, BatchPhaseChanged):
            self.batch_phases.append(event.describe())
            self.sink.set_tags({"rayacc.batch_phases": "; ".join(self.batch_phases)})
        elif isinstance(event, SharesChanged):
            self.shares.append(event.describe())
            self.sink.set_tags({"rayacc.shares": "; ".join(self.shares)[-7000:]})
        elif isinstance(event, ScheduleChanged):
            self.schedule_changes.append(event.describe())
            self.sink.set_tags({"rayacc.schedule_changes": "; ".join(self.schedule_changes)})
        elif isinstance(event, RunStarted):
            self._rewind(event.step, event.announced_at or time.time())
            if event.mesh:
                self.sink.set_tags({"rayacc.mesh": event.mesh})
            if event.places:  # which mesh coordinates each rank_<r>/* metric is
                places = "; ".join(f"rank {r}: {p}" for r, p in enumerate(event.places))
                self.sink.set_tags({"rayacc.rank_places": places[-7000:]})
            if event.resumed_from is not None:
                self.resumed_at.append(str(event.resumed_from))
                self.sink.set_tags({"rayacc.resumed_at_steps": ",".join(self.resumed_at)})

    def _rewind(self, step: int, started_at: float) -> None:
        """The run made to hold the lineage up to `step`, where a worker group starts (at
        `started_at`, time.time() of its rank 0): the points after it marked discarded."""
        if not self.sink.active:
            return
        last = self.sink.forget_after(step)
        if last is not None:
            self.discarded.append(Discarded(step + 1, last, int(started_at * 1000)))
            self.sink.set_tags({DISCARDED_TAG: marks_tag(self.discarded)})
        # (key, step) pairs the run holds already are not written again
        self.sink.log_step_metrics(self.lineage(step))

    def on_step(self, record: dict[str, Any]) -> None:
        self.sink.log_step_metrics([record])

    def close(
        self,
        status: str,
        *,
        history: Sequence[dict[str, Any]] = (),
        checkpoint_dir: str | None = None,
        worker_nodes: Sequence[str] = (),
        loss_curve: Path | None = None,
        wall_time_s: float | None = None,
        goodput: dict[str, float] | None = None,
        model: str | None = None,
        weights: Callable[[], Any] | None = None,
    ) -> None:
        """Final tags, the goodput split (`goodput/…`), the loss curve and the run's status."""
        if status == "FINISHED":
            self.sink.set_tags(
                {
                    "rayacc.checkpoint_dir": checkpoint_dir,
                    "rayacc.worker_nodes": ",".join(worker_nodes),
                    **({"rayacc.wall_time_s": f"{wall_time_s:.3f}"} if wall_time_s else {}),
                }
            )
            if goodput:
                # this fit's split, at its last step (a resumed run holds one per fit)
                last = history[-1]["step"] if history else 0
                split = {f"goodput/{k}": v for k, v in goodput.items()}
                self.sink.log_step_metrics([{"step": last, **split}])
            if checkpoint_dir and model and history:
                # the run's final model: its checkpoint, output of the run at its last step
                last = history[-1]["step"]
                self.sink.log_model_of(f"{model}-step{last}", last, checkpoint_dir, model,
                                       weights)  # fmt: skip
            if loss_curve is not None and loss_curve_png(list(history), loss_curve):
                self.sink.log_artifact(loss_curve)
        self.sink.finish(status)

    def ended_by(self, exc: BaseException) -> str:
        """The run ended by `exc` (any exit after the run opened: a user's mistake a worker
        found, a worker's crash, Ctrl-C): `KILLED` for an interrupt, `FAILED` otherwise, the
        reason a tag (`rayacc.failure`, masked as every tag). The status it set."""
        status = "KILLED" if isinstance(exc, KeyboardInterrupt | SystemExit) else "FAILED"
        reason = f"{type(exc).__name__}: {exc}".strip().rstrip(":")
        try:
            self.sink.set_tags({FAILURE_TAG: reason[-7000:]})
            self.sink.finish(status)
        except Exception:  # the store's own failure must not hide the run's
            pass
        return status


FAILURE_TAG = "rayacc.failure"
"""Why a run ended FAILED or KILLED: the error's kind and its message."""


def _entries(tag: str | None, sep: str) -> list[str]:
    return [e for e in (tag or "").split(sep) if e]


def open_tracking(
    cfg: TrainConfig,
    run: RunIdentity,
    lineage: Lineage = lambda step: (),
) -> TrackedRun:
    """Creates the MLflow run of `cfg` (or reopens `run.previous_run_id`) with the contract
    params, the resolved config and the run's tags. An unreachable store turns tracking off
    with one message (the sink's rule); training goes on. `lineage` reads the records a
    checkpoint holds (`TrackedRun`)."""
    target = tracking_target(cfg.tracking.tracking_uri, cfg.tracking.experiment)
    sink = MlflowSink(
        target.uri,
        target.experiment,
        cfg.tracking.run_name or run.name,
        run_id=run.previous_run_id,
        parent_run_id=run.parent_run_id,
    )
    reopened = run.previous_run_id is not None
    if sink.active and not reopened:
        params = contract_params(cfg, run.split, run.effective_lr)
        if cfg.batch.auto_micro_batch:
            # known once the workers have searched: logged from their event
            del params["micro_batch_size"], params["grad_accum_steps"]
        sink.log_params(params)
        sink.log_text(cfg.to_yaml(), "config.yaml")
        for name, text in run.record_files.items():
            sink.log_text(text, name)
        if run.data is not None:
            sink.log_dataset(
                Path(str(cfg.data.source).rstrip("/")).name or str(cfg.data.source),
                run.data.fingerprint or "unknown",
                run.data.path,
                {
                    "num_rows": run.data.num_rows,
                    "train_rows": run.train_rows,
                    "format": run.data.format,
                },
                "training",
            )
        sink.set_tags(
            {
                # MLflow's description of a run: the batch arithmetic
                "mlflow.note.content": "; ".join(
                    t for t in (run.split.describe(), run.lr_explanation) if t
                ),
                "rayacc.run_name": run.name,
                "rayacc.storage_path": run.storage_path,
                "rayacc.data_layout": run.data_layout,
                "rayacc.num_parameters": run.num_parameters,
                **run.tags,
            }
        )
    return TrackedRun(sink, reopened, lineage=lineage)


def run_model_reader(cfg, path: str) -> Callable[[], Any]:
    """What reads a run's model from its checkpoint at `path`, on the driver that ran it
    (`cfg`: its TrainConfig), for its logged model: `load_model` with the factory and a LoRA
    run's base weights the run's own config names (trusted as `rayacc sample` trusts them
    when named)."""
    from rayacc.checkpoint import load_model

    m = cfg.model
    factory = m.factory if m.name == "factory" else None
    base = m.hf.weights if m.lora is not None and m.name == "hf" and m.hf.weights else None
    return lambda: load_model(path, factory=factory, base=base)
