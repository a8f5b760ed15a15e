"""Every place a config or a command names — the run's storage path, the tracking URI, the data
cache, output folders — checked before anything starts: a scheme rayacc or MLflow can use, the
right kind (a folder, not a file), and writable where rayacc writes, or creatable. Each mistake
is a `PlaceError` naming the field or option and the fix; all of them at once."""

from __future__ import annotations

import os
from pathlib import Path

from rayacc.config import TrainConfig
from rayacc.redact import redact
from rayacc.tracking.mlflow_sink import URI_ENV

__all__ = [
    "PlaceError",
    "check_folder",
    "check_places",
    "check_tracking_uri",
    "path_text_problem",
    "shown",
    "storage_problem",
    "storage_scheme_problem",
]

TRACKING_SCHEMES = (
    "sqlite",
    "http",
    "https",
    "postgresql",
    "mysql",
    "mssql",
    "databricks",
    "databricks-uc",
)
"""Tracking URIs MLflow 3 stores runs at (a plain folder, MLflow's old file store, is refused
by MLflow since 3.13)."""


class PlaceError(ValueError):
    """Places named by a config or command that cannot be used: every one, each with its fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(f"{len(problems)} place(s) cannot be used:\n  " + "\n  ".join(problems))

    def __reduce__(self):
        # rebuilt from its parts where it is unpickled (an error crossing processes, as Ray
        # carries a worker's to the driver): the default would pass the message alone
        return type(self), (self.problems,)


NAME_MAX, PATH_MAX = 255, 4095
"""The longest file name and path (bytes) Linux file systems take."""


def shown(value: str) -> str:
    """`value` as a message quotes it: whole (repr) up to 80 characters, else its start and
    its length (a 10 KB value would bury the message)."""
    return repr(value) if len(value) <= 80 else f"{value[:40]!r}… ({len(value)} characters)"


def path_text_problem(field: str, value: str) -> str | None:
    """Why `value` cannot name a local path at all, or None: a control character (a line
    break would be taken as part of the name), or a name or path longer than the system takes
    (asked about, such a path raises instead of answering)."""
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        return (
            f"{field}={redact(shown(value))} holds a line break or a control character. Fix: "
            "name the folder on one line"
        )
    parts = Path(value).expanduser().parts
    if len(os.fsencode(value)) > PATH_MAX or any(len(os.fsencode(p)) > NAME_MAX for p in parts):
        return (
            f"{field}={redact(shown(value))} is longer than a path can be ({NAME_MAX} bytes a "
            f"name, {PATH_MAX} a path). Fix: name a shorter path"
        )
    return None


def check_folder(field: str, value: str, *, writes: bool = True) -> str | None:
    """Why the local folder `value` (named by `field`) cannot be used, or None: it is a folder
    a probe can be written in, or one can be made (a probe folder is made and removed in its
    nearest existing parent). Tried, not read from permission bits: root passes every bit, and
    a read-only mount or a filesystem that takes no folders shows only when tried."""
    if problem := path_text_problem(field, value):
        return problem
    if "://" in value:
        # a local folder is wanted: the path would fold `//` and write under `scheme:/…`
        return f"{field}={redact(value)!r} is a URI. Fix: name a local folder"
    path = Path(value).expanduser()
    if path.exists():
        if not path.is_dir():
            return f"{field}={value!r} is a file, not a folder. Fix: name a folder"
        if writes and (why := _try_writing(path)):
            return f"{field}={value!r} is not writable ({why}). Fix: name a folder you can write to"
        return None
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is None or not parent.is_dir():
        return f"{field}={value!r} cannot be created under {parent}. Fix: name a folder"
    if why := _try_writing(parent):
        return (
            f"{field}={value!r} does not exist and cannot be created in {parent} ({why}). Fix: "
            "create it, or name a folder you can write to"
        )
    return None


def _try_writing(folder: Path) -> str | None:
    """Why a folder cannot be made in `folder` (the error's text), or None; nothing is left."""
    import tempfile

    try:
        probe = tempfile.mkdtemp(prefix=".rayacc-probe-", dir=folder)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    os.rmdir(probe)
    return None


def storage_problem(field: str, value: str) -> str | None:
    """Why the storage URI `value` (named by `field`) cannot be opened, None when it can."""
    from pyarrow import fs

    try:
        fs.FileSystem.from_uri(value)
    except Exception as exc:  # pyarrow says which scheme it does not know, or what is missing
        return (
            f"{field}={redact(value)!r} cannot be reached ({type(exc).__name__}: "
            f"{redact(str(exc)).splitlines()[0][:160]}). Fix: give a local path, or a URI "
            "pyarrow reaches (s3://, gs://, abfs://, hdfs://, file://) with its credentials set"
        )
    return None


def check_tracking_uri(field: str, uri: str, *, recorded: bool = False) -> str | None:
    """Why MLflow cannot store runs at `uri`, or None. `recorded`: the store is read, so it
    must exist (MLflow would create an empty database at a mistyped sqlite path, and report
    nothing found in it)."""
    from urllib.parse import urlparse

    # as MLflow reads it: `databricks` alone (or `databricks-uc`) is the default profile's
    # workspace; a scheme may carry a driver (`postgresql+psycopg2`)
    if uri.strip().lower() in ("databricks", "databricks-uc"):
        return None
    scheme = urlparse(uri).scheme.split("+", 1)[0].lower()
    if scheme not in TRACKING_SCHEMES:
        return (
            f"{field}={redact(shown(uri))} is not a tracking store MLflow 3 writes to (a plain "
            "folder, MLflow's file store, is refused since MLflow 3.13). Fix: use "
            "sqlite:///ABSOLUTE/PATH/mlflow.db, or an http(s):// tracking server, or a "
            "database URI (postgresql://, mysql://)"
        )
    if scheme == "sqlite":
        from rayacc.tracking.sqlite_store import sqlite_path

        path = sqlite_path(uri)
        if path is None:
            return None  # sqlite:// in memory: MLflow's own business
        if problem := path_text_problem(f"the file of {field}", str(path)):
            return problem
        if path.is_dir():
            return f"{field}={uri!r} names a folder, not a database file. Fix: end it in .db"
        if path.is_file() and (why := _not_sqlite(path, recorded)):
            return (
                f"{field}={redact(uri)!r}: {path} {why}. Fix: pass the tracking URI the runs "
                "are recorded in (a file MLflow made), or a new file's"
            )
        if recorded and not path.is_file():
            return (
                f"{field}={redact(uri)!r}: no tracking store there (no such file), so no run "
                "to read. Fix: pass the tracking URI the runs were recorded in (rayacc train "
                "prints it under its summary)"
            )
        return check_folder(f"the folder of {field}={uri!r}:", str(path.parent))
    return None


def _not_sqlite(path: Path, recorded: bool) -> str | None:
    """Why the file at `path` is no MLflow store to use, None when it may be one: an SQLite
    database (its 16-byte header), or an empty file where a store is to be made."""
    try:
        with path.open("rb") as f:
            head = f.read(16)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if not head:
        return "is empty: no runs are recorded there" if recorded else None
    if head != b"SQLite format 3\x00":
        return "is not an SQLite database (MLflow's sqlite store is one)"
    return None


STORAGE_SCHEMES = ("s3", "gs", "gcs", "abfs", "abfss", "hdfs", "viewfs", "file")
"""URI schemes pyarrow's filesystems read and write."""


def storage_scheme_problem(uri: str) -> str | None:
    """Why the scheme of the storage URI `uri` is not one rayacc writes to, None when it is."""
    scheme = uri.split("://", 1)[0].lower()
    if scheme in STORAGE_SCHEMES:
        return None
    return (
        f"{scheme}:// is not a storage rayacc writes to. Fix: use one of "
        f"{', '.join(s + '://' for s in STORAGE_SCHEMES)}"
    )


def check_places(cfg: TrainConfig, here: bool = True) -> None:
    """Raises PlaceError listing every place of `cfg` that cannot be used. `here=False` (a job
    for a cluster, whose paths are the cluster's) checks only what this machine can judge: the
    schemes of the URIs."""
    problems = []
    storage = cfg.run.storage_path
    if storage is not None and "://" in storage:
        if not here:
            if problem := storage_scheme_problem(storage):
                problems.append(f"run.storage_path={redact(storage)!r}: {problem}")
        else:
            problems.append(storage_problem("run.storage_path", storage))
    elif storage is not None and here:
        problems.append(check_folder("run.storage_path", storage))
    uri, field = cfg.tracking.tracking_uri, "tracking.tracking_uri"
    if uri is None and here and os.environ.get(URI_ENV):
        # MLflow's variable stands in for the field: the same checks, named as it
        uri, field = os.environ[URI_ENV], URI_ENV
    # a sqlite file of a submitted job is on the cluster: its scheme is all there is to judge
    if cfg.tracking.enabled and uri is not None and (here or not uri.startswith("sqlite:")):
        problems.append(check_tracking_uri(field, uri))
    if cfg.data.cache_dir is not None and here:
        problems.append(check_folder("data.cache_dir", cfg.data.cache_dir))
    found = [p for p in problems if p]
    if found:
        raise PlaceError(found)
