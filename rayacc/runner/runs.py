"""Where a run lives: its folder `storage/name` on a local disk or any storage pyarrow reaches
(`s3://`, `gs://`, `file://`), the rules that keep a name to one run, the identity a resume must
match, and the run's info file (its MLflow run, so that every resume continues that one)."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayacc.config import TrainConfig
from rayacc.data.reads import filesystem_and_path
from rayacc.data.sources import DataError

__all__ = ["LATEST", "RUN_INFO", "RunLocation", "locate_run"]

RUN_INFO = "rayacc_run.json"
"""In the run's folder: the MLflow run id and tracking URI of the run."""
LATEST = "LATEST"
"""In the storage path: the name of the latest run started there (`--resume` without a name)."""


def _read_text(storage: str, relative: str) -> str | None:
    from pyarrow import fs

    filesystem, root = filesystem_and_path(storage)
    path = f"{root}/{relative}"
    if filesystem.get_file_info(path).type != fs.FileType.File:
        return None
    with filesystem.open_input_stream(path) as f:
        return f.read().decode()


def _write_text(storage: str, relative: str, text: str) -> None:
    filesystem, root = filesystem_and_path(storage)
    path = f"{root}/{relative}"
    filesystem.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with filesystem.open_output_stream(path) as f:
        f.write(text.encode())


@dataclass(frozen=True)
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

    def record(self, mlflow_run_id: str | None, tracking_uri: str | None) -> None:
        """Notes the MLflow run in the run's folder (a resume reopens it) and marks this run as
        the latest of its storage path. A run id already recorded is never replaced by none
        (a resume while the tracking server was away)."""
        info = {
            "mlflow_run_id": mlflow_run_id or self.previous.get("mlflow_run_id"),
            "tracking_uri": tracking_uri or self.previous.get("tracking_uri"),
        }
        _write_text(self.storage, f"{self.name}/{RUN_INFO}", json.dumps(info))
        _write_text(self.storage, LATEST, self.name)


def locate_run(cfg: TrainConfig, resume: bool) -> RunLocation:
    """The run's storage path and name: `run.name`, else on a resume the latest run of the
    storage path, else a fresh unique name. A name means one run: a fresh run may not reuse
    the name of one that exists (Ray Train would silently continue it), and a resume needs an
    existing run (whether its checkpoint may be resumed by this config: `prelaunch.locate`)."""
    storage = cfg.run.storage_path or str(Path.cwd() / "rayacc_runs")
    if "://" not in storage:
        storage = str(Path(storage).expanduser().resolve())
    name = cfg.run.name
    if name is None and resume:
        latest = _read_text(storage, LATEST)
        if latest is None:
            raise DataError(
                f"--resume: no previous run recorded in {storage}. "
                "Fix: set run.name to the run to resume"
            )
        name = latest.strip()
    elif name is not None:
        _check_name(storage, name, resume)
    name = name or f"rayacc-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    loc = RunLocation(storage, name)
    recorded = _read_text(storage, f"{name}/{RUN_INFO}") if resume else None
    return RunLocation(storage, name, json.loads(recorded)) if recorded else loc


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


def latest_checkpoint_meta(loc: RunLocation) -> dict[str, Any] | None:
    """meta.json of the run's newest complete checkpoint folder, if any."""
    from pyarrow import fs

    filesystem, root = filesystem_and_path(loc.storage)
    infos = filesystem.get_file_info(fs.FileSelector(f"{root}/{loc.name}", allow_not_found=True))
    folders = sorted(
        (i.base_name for i in infos if i.type == fs.FileType.Directory),
        reverse=True,
    )
    for folder in (f for f in folders if f.startswith("checkpoint_")):
        text = _read_text(loc.storage, f"{loc.name}/{folder}/meta.json")
        if text is not None:
            return json.loads(text)
    return None
