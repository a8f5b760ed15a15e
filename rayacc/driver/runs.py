"""Where a run lives: its folder `storage/name` on a local disk or any storage pyarrow reaches
(`s3://`, `gs://`, `file://`), the rules that keep a name to one run, which run a `--resume`
without a name means, the run's info file (its MLflow run, so that every resume continues that
one, and what `rayacc runs` lists), the lease a live driver holds on its run (one writer per
run), and the list of a storage path's runs."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayacc.config import TrainConfig
from rayacc.data.reads import filesystem_and_path, read_bytes
from rayacc.data.sources import DataError
from rayacc.redact import redact
from rayacc.worker.checkpoint import RunCheckpoints

__all__ = [
    "LATEST",
    "LEASE",
    "LEASE_TTL_S",
    "RUN_INFO",
    "Lease",
    "RunLease",
    "RunLocation",
    "RunSummary",
    "default_storage",
    "list_runs",
    "read_lease",
    "storage_exists",
]

RUN_INFO = "rayacc_run.json"
"""In the run's folder: the MLflow run, job file, model, data, identity, planned steps and
status of the run."""
LATEST = "LATEST"
"""In the storage path: the name of the latest run started there."""
LEASE = "rayacc_lease.json"
"""In the run's folder while a driver writes the run: its host, pid and heartbeat."""
LEASE_TTL_S = 60.0
"""A lease whose heartbeat is older than this is a killed driver's: it holds the run no more
(the holder beats every quarter of it)."""


def _write_text(storage: str, relative: str, text: str) -> None:
    filesystem, root = filesystem_and_path(storage)
    path = f"{root}/{relative}"
    filesystem.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with filesystem.open_output_stream(path) as f:
        f.write(text.encode())


def _run_info(storage: str, name: str) -> dict[str, Any]:
    """The run's info file (none yet: {}); a damaged one is a DataError naming it: a resume
    would otherwise lose which MLflow run it continues."""
    source = f"{redact(storage)}/{name}/{RUN_INFO}"
    text = read_bytes(f"{storage}/{name}/{RUN_INFO}")
    if not text:
        return {}
    try:
        info = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        info = None
    if not isinstance(info, dict):
        raise DataError(
            f"{source} is not the JSON rayacc writes (damaged, or written by something else). "
            "Fix: restore it, or delete it (the run's checkpoints stay; a resume then starts a "
            "new MLflow run)"
        )
    return info


@dataclass(frozen=True)
class Lease:
    """A driver's claim on a run: while its heartbeat is fresh (and, on this host, its process
    lives) no other driver writes the run."""

    host: str
    pid: int
    heartbeat: float
    token: str

    def live(self) -> bool:
        if time.time() - self.heartbeat > LEASE_TTL_S:
            return False
        if self.host == socket.gethostname():
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False  # a driver of this host that is gone: no need to wait it out
            except PermissionError:
                pass
        return True

    def describe(self) -> str:
        age = max(0.0, time.time() - self.heartbeat)
        return f"host {self.host}, pid {self.pid}, heartbeat {age:.0f} s ago"


def read_lease(storage: str, name: str) -> Lease | None:
    text = read_bytes(f"{storage}/{name}/{LEASE}")
    try:
        raw = json.loads(text) if text else None
        return Lease(str(raw["host"]), int(raw["pid"]), float(raw["heartbeat"]), str(raw["token"]))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        return None  # none, or a torn write: no claim


class RunLease:
    """The lease this driver holds on its run for the fit's length: taken before the worker
    group starts (refused while another live driver holds it), its heartbeat refreshed by a
    thread, removed when the fit ends. A driver that is killed leaves it to expire."""

    def __init__(self, loc: RunLocation):
        self.loc = loc
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self) -> None:
        lease = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "heartbeat": time.time(),
            "token": self.token,
        }
        _write_text(self.loc.storage, f"{self.loc.name}/{LEASE}", json.dumps(lease))

    def take(self) -> RunLease:
        held = read_lease(self.loc.storage, self.loc.name)
        if held is not None and held.token != self.token and held.live():
            raise DataError(_held_message(self.loc.name, self.loc.storage, held))
        self._write()
        # two drivers that read "free" at once: the one whose lease stands goes on
        time.sleep(0.05)
        mine = read_lease(self.loc.storage, self.loc.name)
        if mine is None or mine.token != self.token:
            raise DataError(_held_message(self.loc.name, self.loc.storage, mine))
        self._thread = threading.Thread(target=self._beat, name="rayacc-lease", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(LEASE_TTL_S / 4):
            # storage away for a moment: the next beat tries again
            with contextlib.suppress(OSError):
                self._write()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        held = read_lease(self.loc.storage, self.loc.name)
        if held is not None and held.token == self.token:
            filesystem, root = filesystem_and_path(self.loc.storage)
            filesystem.delete_file(f"{root}/{self.loc.name}/{LEASE}")


def _held_message(name: str, storage: str, held: Lease | None) -> str:
    who = held.describe() if held is not None else "another driver"
    return (
        f"run {name!r} in {storage} is being written by a live driver ({who}); two drivers "
        "would write one folder and one MLflow run. Fix: wait for it to end (`rayacc runs` "
        f"shows it running), stop it, or resume another run; a lease a killed driver left "
        f"expires {LEASE_TTL_S:.0f} s after its last heartbeat"
    )


def storage_exists(storage: str) -> bool:
    """Whether the storage path (a folder, or a URI's prefix) exists."""
    from pyarrow import fs

    filesystem, root = filesystem_and_path(storage)
    return filesystem.get_file_info(root).type == fs.FileType.Directory


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
    notes: list[str] = []
    if name is None and resume:
        name = _same_job(storage, identity, notes)
    elif name is not None:
        _check_name(storage, name, resume)
        held = read_lease(storage, name) if resume else None
        if held is not None and held.live():
            raise DataError(_held_message(name, storage, held))
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
    lease: Lease | None = None
    """The live driver's lease, while one writes the run."""

    def line(self) -> str:
        total = self.total_steps if self.total_steps is not None else "?"
        return (
            f"{self.name}: job {self.job or '?'}, {self.model or '?'} on {self.data or '?'}, "
            f"step {self.steps_done}/{total}, {self.status}, started {self.started or '?'}"
        )


def list_runs(storage: str) -> list[RunSummary]:
    """The runs of `storage`, oldest first. A run reads `running` while a live driver holds its
    lease; one whose info says `running` and whose driver is gone reads `unfinished` (a resume
    continues it)."""
    found = []
    for name in _runs_in(storage):
        try:
            info = _run_info(storage, name)
            unreadable = False
        except DataError:
            info, unreadable = {}, True  # listed all the same, marked
        latest = RunCheckpoints(storage, name).latest()
        if not info and latest is None:
            continue  # not a rayacc run
        status = info.get("status", "unfinished")
        lease = read_lease(storage, name)
        live = lease is not None and lease.live()
        if live:
            status = "running"
        elif unreadable:
            status = f"unknown ({RUN_INFO} damaged)"
        elif status == "running":
            status = "unfinished"  # its driver is gone
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
                status=status,
                started=info.get("started", ""),
                identity=identity,
                lease=lease if live else None,
            )
        )
    return sorted(found, key=lambda r: (r.started, r.name))
