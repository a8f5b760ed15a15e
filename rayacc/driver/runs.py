"""Where a run lives: its folder `storage/name` on a local disk or any storage pyarrow reaches
(`s3://`, `gs://`, `file://`), the rules that keep a name to one run, which run a `--resume`
without a name means, the run's info file (its MLflow run, so that every resume continues that
one, and what `rayacc runs` lists), the lease a live driver holds on its run (one writer per
run), and the list of a storage path's runs."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayacc.checkpoint.catalogue import RunCheckpoints
from rayacc.checkpoint.lease import Lease, held_message, read_lease
from rayacc.checkpoint.reader import CheckpointError
from rayacc.checkpoint.storage import open_storage
from rayacc.config.schema import RunConfig
from rayacc.data.common import DataError
from rayacc.redact import redact

__all__ = [
    "LATEST",
    "RUN_INFO",
    "RunLocation",
    "RunSummary",
    "default_storage",
    "list_runs",
    "run_names",
    "storage_exists",
]

RUN_INFO = "rayacc_run.json"
"""In the run's folder: the MLflow run, job file, model, data, identity, planned steps and
status of the run."""
LATEST = "LATEST"
"""In the storage path: the name of the latest run started there."""


def _write_text(storage: str, relative: str, text: str) -> None:
    open_storage(storage).put(relative, text.encode())


def _run_info(storage: str, name: str) -> dict[str, Any]:
    """The run's info file (none yet: {}); a damaged one is a DataError naming it: a resume
    would otherwise lose which MLflow run it continues."""
    source = f"{redact(storage)}/{name}/{RUN_INFO}"
    try:
        text = open_storage(storage).child(name).read(RUN_INFO)
    except OSError:
        text, info = b"?", None  # a link or a folder where the file belongs
    if text is None:
        return {}
    try:
        info = json.loads(text)
    except (ValueError, RecursionError):
        info = None
    if not isinstance(info, dict):
        raise DataError(
            f"{source} is not the JSON rayacc writes (damaged, or written by something else). "
            "Fix: restore it, or delete it (the run's checkpoints stay; a resume then starts a "
            "new MLflow run)"
        )
    return info


def recorded_store(storage: str, name: str) -> str | None:
    """The tracking URI run `name` of `storage` was recorded in (its info file's), or None: no
    such run folder here, or none recorded."""
    if "/" in name or name in ("", ".", "..") or not storage_exists(storage):
        return None
    try:
        uri = _run_info(storage, name).get("tracking_uri")
    except DataError:
        return None
    return uri if isinstance(uri, str) and uri else None


def storage_exists(storage: str) -> bool:
    """Whether the storage path (a folder, or a URI's prefix) exists."""
    root = open_storage(storage)
    entry = root.stat("")
    return entry is not None and entry.kind == "dir"


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
    notes: list[str] = field(default_factory=list)
    """What the choice of the run should tell the user (a live run passed over)."""
    resume_step: int | None = None
    """On a resume: the optimizer step of the checkpoint it continues from (None: none)."""
    overrides: list[str] | None = None
    """The command line's overrides this run goes on with (recorded: a resume starts from
    them, `driver/resume.py`)."""

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


def locate_run(run: RunConfig, resume: bool, identity: dict[str, Any] | None = None):
    """The run's storage path and name: `run.name`; else, on a resume, the latest run of the
    storage path with this `identity` (the same job: data, model, seed); else a fresh unique
    name. A name means one run: a fresh run may not reuse the name of one that exists (Ray Train
    would silently continue it), and a resume needs an existing run (whether its checkpoint
    may be resumed by this config: `prelaunch.locate`)."""
    storage = default_storage(run.storage_path)
    name = run.name
    notes: list[str] = []
    if name is None and resume:
        name = _same_job(storage, identity, notes)
    elif name is not None:
        _check_name(storage, name, resume)
        held = read_lease(storage, name) if resume else None
        if held is not None and held.driver_lives():
            raise DataError(held_message(name, storage, held))
    name = name or f"rayacc-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    return RunLocation(storage, name, _run_info(storage, name) if resume else {}, notes)


def _same_job(storage: str, identity: dict[str, Any] | None, notes: list[str]) -> str:
    """The latest run in `storage` whose identity is `identity` and that no live driver
    writes (one passed over is noted); a DataError listing the runs there when none is."""
    runs = list_runs(storage)
    same = [r for r in runs if identity is not None and r.identity == identity]
    free = [r for r in same if r.status != "running"]
    for r in same:
        if r.status == "running":
            notes.append(
                f"--resume passed over run {r.name!r}: a live driver writes it "
                f"({r.lease.describe() if r.lease else 'lease held'})"
            )
    if free:
        return max(free, key=lambda r: r.started).name
    listing = "\n  ".join(r.line() for r in runs[-10:]) or "none"
    busy = " that no live driver writes" if same else ""
    raise DataError(
        f"--resume without run.name: no run in {storage}{busy} was trained on this job's data "
        f"and model (runs there, newest last):\n  {listing}\nFix: set run.name=NAME to the run "
        "to resume (`rayacc runs` lists them), or drop --resume to start a new run"
    )


def _check_name(storage: str, name: str, resume: bool) -> None:
    runs = run_names(storage)
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


def run_names(storage: str) -> set[str]:
    """The names of the run folders in `storage` (not `_data`, where shared data is staged)."""
    return {e.name for e in open_storage(storage).list() if e.kind == "dir"} - {"_data"}


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
    lease: Lease | None = None
    """The live driver's lease, while one writes the run."""
    passed_over: list[str] = field(default_factory=list)
    """Its newer checkpoints not counted (not whole, or not readable), each said."""
    kind: str | None = None
    """What the run is for where it is not training: `verify` (a one-step probe)."""

    def line(self) -> str:
        total = self.total_steps if self.total_steps is not None else "?"
        return (
            f"{self.name}: job {self.job or '?'}, {self.model or '?'} on {self.data or '?'}, "
            f"step {self.steps_done}/{total}, {self.status}, started {self.started or '?'}"
        )


def _meta_of(checkpoint) -> dict[str, Any]:
    try:
        return checkpoint.meta()
    except (CheckpointError, OSError):
        return {}  # changed since it was listed whole: the run is listed without it


def list_runs(storage: str) -> list[RunSummary]:
    """The runs of `storage`, oldest first. A run reads `running` while a live driver holds its
    lease; one whose info says `running` and whose driver is gone reads `unfinished` (a resume
    continues it)."""
    found = []
    for name in run_names(storage):
        try:
            info = _run_info(storage, name)
            unreadable = False
        except DataError:
            info, unreadable = {}, True  # listed all the same, marked
        checkpoints = RunCheckpoints(storage, name)
        latest = checkpoints.latest()
        if not info and latest is None and not unreadable:
            continue  # not a rayacc run
        status = info.get("status", "unfinished")
        lease = read_lease(storage, name)
        live = lease is not None and lease.driver_lives()
        if live:
            status = "running"
        elif unreadable:
            status = f"unknown ({RUN_INFO} damaged)"
        elif status == "running":
            status = "unfinished"  # its driver is gone
        identity = info.get("identity") or (_meta_of(latest).get("identity") if latest else None)
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
                status=status,
                started=info.get("started", ""),
                identity=identity,
                lease=lease if live else None,
                passed_over=checkpoints.skipped,
                kind=info.get("kind") if isinstance(info.get("kind"), str) else None,
            )
        )
    return sorted(found, key=lambda r: (r.started, r.name))
