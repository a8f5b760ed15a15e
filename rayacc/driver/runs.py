"""Where a run lives: its folder `storage/name` on a local disk or any storage pyarrow reaches
(`s3://`, `gs://`, `file://`), the rules that keep a name to one run, which run a `--resume`
without a name means, the run's info file (its MLflow run, so that every resume continues that
one, and what `rayacc runs` lists), and the list of a storage path's runs."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayacc.config import TrainConfig
from rayacc.data.reads import filesystem_and_path, read_text
from rayacc.data.sources import DataError
from rayacc.redact import redact
from rayacc.worker.checkpoint import RunCheckpoints

__all__ = ["LATEST", "RUN_INFO", "RunLocation", "RunSummary", "default_storage", "list_runs"]

RUN_INFO = "rayacc_run.json"
"""In the run's folder: the MLflow run, job file, model, data, identity, planned steps and
status of the run."""
LATEST = "LATEST"
"""In the storage path: the name of the latest run started there."""


def _write_text(storage: str, relative: str, text: str) -> None:
    filesystem, root = filesystem_and_path(storage)
    path = f"{root}/{relative}"
    filesystem.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with filesystem.open_output_stream(path) as f:
        f.write(text.encode())


def _run_info(storage: str, name: str) -> dict[str, Any]:
    text = read_text(f"{storage}/{name}/{RUN_INFO}")
    try:
        return json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {}


def default_storage(path: str | None = None) -> str:
    """`run.storage_path` (a local path made absolute, or a URI); unset: ./rayacc_runs."""
    storage = path or str(Path.cwd() / "rayacc_runs")
    return storage if "://" in storage else str(Path(storage).expanduser().resolve())


@dataclass
class RunLocation:
    """The run's folder: `storage`/`name` (a local path or a URI)."""

    storage: str
    name: str
    previous: dict[str, Any] = field(default_factory=dict)
    """What an earlier attempt of this run recorded in its folder (on a resume)."""

    @property
    def local(self) -> bool:
        return "://" not in self.storage

    @property
    def run_dir(self) -> Path:
        return Path(self.storage) / self.name

    @property
    def checkpoints(self) -> RunCheckpoints:
        return RunCheckpoints(self.storage, self.name)

    def record(self, **fields: Any) -> None:
        """Updates the run's info file with `fields` (a None never replaces a recorded value:
        a resume while the tracking server was away keeps the MLflow run) and marks this run
        as the latest of its storage path."""
        info = {**self.previous}
        info.update({k: v for k, v in fields.items() if v is not None})
        info["updated"] = time.strftime("%Y-%m-%d %H:%M:%S")
        info.setdefault("started", info["updated"])
        self.previous = info
        _write_text(self.storage, f"{self.name}/{RUN_INFO}", json.dumps(redact(info)))
        _write_text(self.storage, LATEST, self.name)


def locate_run(cfg: TrainConfig, resume: bool, identity: dict[str, Any] | None = None):
    """The run's storage path and name: `run.name`; else, on a resume, the latest run of the
    storage path with this `identity` (the same job: data, model, seed); else a fresh unique
    name. A name means one run: a fresh run may not reuse the name of one that exists (Ray Train
    would silently continue it), and a resume needs an existing run (whether its checkpoint
    may be resumed by this config: `prelaunch.locate`)."""
    storage = default_storage(cfg.run.storage_path)
    name = cfg.run.name
    if name is None and resume:
        name = _same_job(storage, identity)
    elif name is not None:
        _check_name(storage, name, resume)
    name = name or f"rayacc-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    return RunLocation(storage, name, _run_info(storage, name) if resume else {})


def _same_job(storage: str, identity: dict[str, Any] | None) -> str:
    """The latest run in `storage` whose identity is `identity`; a DataError listing the runs
    there when none is."""
    runs = list_runs(storage)
    same = [r for r in runs if identity is not None and r.identity == identity]
    if same:
        return max(same, key=lambda r: r.started).name
    listing = "\n  ".join(r.line() for r in runs[-10:]) or "none"
    raise DataError(
        f"--resume without run.name: no run in {storage} was trained on this job's data and "
        f"model (runs there, newest last):\n  {listing}\nFix: set run.name=NAME to the run to "
        "resume (`rayacc runs` lists them), or drop --resume to start a new run"
    )


def _check_name(storage: str, name: str, resume: bool) -> None:
    runs = _runs_in(storage)
    if resume and name not in runs:
        known = ", ".join(sorted(runs)[:10]) or "none"
        raise DataError(
            f"--resume: no run named run.name={name!r} in {storage} (runs there: {known}). Fix: "
            "give the name of an existing run, or drop --resume to start a new one"
        )
    if not resume and name in runs:
        raise DataError(
            f"run.name={name!r} already names a run in {storage}; starting it again would "
            "continue or overwrite that run. Fix: add --resume to continue it, or choose another "
            "run.name (or leave it unset for a fresh unique name)"
        )


def _runs_in(storage: str) -> set[str]:
    """The names of the run folders in `storage` (not `_data`, where shared data is staged)."""
    from pyarrow import fs

    filesystem, root = filesystem_and_path(storage)
    infos = filesystem.get_file_info(fs.FileSelector(root, allow_not_found=True))
    return {i.base_name for i in infos if i.type == fs.FileType.Directory} - {"_data"}


@dataclass
class RunSummary:
    """One run of a storage path, as `rayacc runs` lists it."""

    name: str
    job: str | None
    model: str | None
    data: str | None
    steps_done: int
    total_steps: int | None
    last_checkpoint: str | None
    mlflow_run_id: str | None
    status: str
    started: str
    identity: dict[str, Any] | None

    def line(self) -> str:
        total = self.total_steps if self.total_steps is not None else "?"
        return (
            f"{self.name}: job {self.job or '?'}, {self.model or '?'} on {self.data or '?'}, "
            f"step {self.steps_done}/{total}, {self.status}, started {self.started or '?'}"
        )


def list_runs(storage: str) -> list[RunSummary]:
    """The runs of `storage`, oldest first. A run whose info says `running` and whose driver is
    gone reads `unfinished` (a resume continues it)."""
    found = []
    for name in _runs_in(storage):
        info = _run_info(storage, name)
        latest = RunCheckpoints(storage, name).latest()
        if not info and latest is None:
            continue  # not a rayacc run
        status = info.get("status", "unfinished")
        identity = info.get("identity") or (latest.meta().get("identity") if latest else None)
        found.append(
            RunSummary(
                name=name,
                job=info.get("job"),
                model=info.get("model"),
                data=redact(info["data"]) if info.get("data") else None,
                steps_done=latest.step if latest else 0,
                total_steps=info.get("total_steps"),
                last_checkpoint=latest.uri if latest else None,
                mlflow_run_id=info.get("mlflow_run_id"),
                status="unfinished" if status == "running" else status,
                started=info.get("started", ""),
                identity=identity,
            )
        )
    return sorted(found, key=lambda r: (r.started, r.name))
