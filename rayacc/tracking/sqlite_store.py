"""A new sqlite MLflow store, made from an empty one kept in the cache.

Creating a sqlite store runs MLflow's schema migrations: about 1.5 s of CPU on a small machine,
paid by every run that starts a new `mlflow.db` (and on 2 cores taken from the worker group
starting beside it). The first new store of an MLflow version is created by MLflow itself and
kept, empty, under the cache (`RAYACC_CACHE`); later new stores are copies of it, with the
default experiment's artifact location and times set as MLflow would have set them.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path

from rayacc import env

__all__ = ["prepare_sqlite_store", "sqlite_path"]


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a `sqlite:///` URI (absolute or relative to the working folder);
    None for any other store."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix) or "?" in tracking_uri:
        return None
    rest = tracking_uri[len(prefix) :]
    return Path(rest) if rest and rest != ":memory:" else None


def prepare_sqlite_store(tracking_uri: str) -> bool:
    """Puts a copy of the cached empty store where a `sqlite:///` URI names a file that does
    not exist yet; True when it did. Anything else (another store, an existing file, a copy
    that fails) is left to MLflow, which creates the store itself."""
    path = sqlite_path(tracking_uri)
    if path is None or path.exists() or not path.parent.is_dir():
        return False
    try:
        template = _template()
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        shutil.copyfile(template, tmp)
        env.umask_modes(Path(tmp))  # MLflow's UI of another user reads it
        _adopt(Path(tmp))
        try:
            # fails if another process created the store meanwhile: theirs stands
            os.link(tmp, path)
        finally:
            os.unlink(tmp)
    except (OSError, sqlite3.Error, ImportError):
        return False
    return True


def _template() -> Path:
    """The cached empty store of the installed MLflow version, created on first use."""
    import mlflow

    folder = env.cache_dir() / "mlflow"
    template = folder / f"empty-{mlflow.__version__}.db"
    if template.is_file():
        return template
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        db = Path(tmp) / "empty.db"
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
        os.replace(db, template)
    return template


def _adopt(db: Path) -> None:
    """The default experiment as MLflow creates it for a store opened here (its artifact
    location follows the working folder, or the server's artifact root), created now."""
    from mlflow.store.tracking import DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH
    from mlflow.tracking._tracking_service.utils import _SERVER_ARTIFACT_ROOT_ENV_VAR
    from mlflow.utils.uri import append_to_uri_path, resolve_uri_if_local

    root = os.environ.get(_SERVER_ARTIFACT_ROOT_ENV_VAR, DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH)
    location = str(append_to_uri_path(resolve_uri_if_local(root), "0"))
    now = int(time.time() * 1000)
    with sqlite3.connect(db) as conn:
        conn.execute(
            "UPDATE experiments SET artifact_location = ?, creation_time = ?, "
            "last_update_time = ? WHERE experiment_id = 0",
            (location, now, now),
        )
    conn.close()
