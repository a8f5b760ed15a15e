"""Putting a rank's part of a checkpoint into storage: staged in a local folder, then every file
put whole through the storage seam, its manifest last, then checked in storage. Under retry (a
throttled or flaky store, Ray Train's own retry of the upload) it sends the same complete files
again; the staging folder is kept until the part is in storage or the attempt is abandoned, and
removed on every way out. A process killed mid-upload (a group torn down) leaves its staging
folder behind: the next group's ranks on that node remove it (`sweep_stale_staging`).
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rayacc.checkpoint.format import part_files, part_manifest
from rayacc.checkpoint.lease import process_alive
from rayacc.checkpoint.storage import Storage
from rayacc.redact import redact

__all__ = [
    "STAGING_PREFIX",
    "PartUpload",
    "UploadError",
    "staging_folder",
    "stale_staging",
    "sweep_stale_staging",
]

STAGING_PREFIX = "rayacc-checkpoint-"
"""Staging folders are `<TMPDIR>/rayacc-checkpoint-<host>-<pid>-<random>`: whose they are is
in the name, so a sweep knows which belong to a process that is gone."""
ATTEMPTS = 4
BACKOFF_S = 1.0
"""The pause before the second attempt; it doubles each time (1, 2, 4 s)."""


class UploadError(RuntimeError):
    """A part that could not be put into storage after every attempt."""


def _host() -> str:
    return socket.gethostname().replace("-", "_")


def staging_folder() -> Path:
    return Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{_host()}-{os.getpid()}-"))


def stale_staging(tmp: str | Path | None = None) -> list[Path]:
    """The staging folders of this host's processes that are gone."""
    folder = Path(tmp or tempfile.gettempdir())
    prefix = f"{STAGING_PREFIX}{_host()}-"
    stale = []
    for path in folder.glob(f"{prefix}*"):
        pid = path.name[len(prefix) :].split("-", 1)[0]
        if (
            pid.isdigit()
            and not process_alive(int(pid))
            and path.is_dir()
            and not path.is_symlink()
        ):
            stale.append(path)
    return sorted(stale)


def sweep_stale_staging(tmp: str | Path | None = None) -> list[Path]:
    """Removes the staging folders processes of this host left when they were killed;
    returns them."""
    stale = stale_staging(tmp)
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def _retryable(exc: BaseException) -> bool:
    # a store's throttle, a dropped connection, a full disk freed meanwhile: OSError; a refusal
    # (a lease lost, a wrong manifest) is not worth a second try
    return isinstance(exc, OSError) and not isinstance(exc, PermissionError)


class PartUpload:
    """One rank's part of one checkpoint, from its staging folder to the checkpoint's folder
    in storage. `prepare` writes the part's files and manifest into staging (once; again only
    if it failed); `commit` (the lease's check) runs right before the manifest is put. `run`
    is idempotent: once the part is in storage a call returns at once; once abandoned, it
    raises the same error again."""

    def __init__(
        self,
        staging: Path,
        destination: Storage,
        *,
        rank: int,
        step: int,
        prepare: Callable[[], None],
        commit: Callable[[], None] | None = None,
        attempts: int = ATTEMPTS,
        backoff_s: float = BACKOFF_S,
    ):
        self.staging, self.destination = staging, destination
        self.rank, self.step = rank, step
        self.prepare, self.commit = prepare, commit
        self.attempts, self.backoff_s = attempts, backoff_s
        self.manifest = part_manifest(rank)
        self.tries = 0
        self.done = False
        self.error: UploadError | None = None
        self._prepared = False
        self._lock = threading.Lock()

    def run(self) -> None:
        with self._lock:
            if self.done:
                return
            if self.error is not None:
                raise self.error
            last: BaseException | None = None
            for attempt in range(self.attempts):
                if attempt:
                    time.sleep(self.backoff_s * 2 ** (attempt - 1))
                self.tries += 1
                try:
                    if not self._prepared:
                        self.prepare()
                        self._prepared = True
                    self._put()
                    self._check()
                except Exception as exc:
                    last = exc
                    if not _retryable(exc):
                        break
                    continue
                self.done = True
                self.discard()
                return
            assert last is not None
            self.error = UploadError(
                f"rank {self.rank}'s part of the checkpoint of step {self.step} could not be "
                f"put into {redact(self.destination.uri())} after {self.tries} attempt(s) "
                f"({type(last).__name__}: {redact(str(last))[:300]})"
            )
            self.error.__cause__ = last
            self.discard()
            raise self.error

    def _files(self) -> list[str]:
        return part_files(self.staging, rank=self.rank)

    def _put(self) -> None:
        for name in self._files():
            self.destination.put_file(name, self.staging / name)
        if self.commit is not None:
            self.commit()
        # last: a part is whole in storage once its manifest is
        self.destination.put_file(self.manifest, self.staging / self.manifest)

    def _check(self) -> None:
        """The part as it is in storage: its manifest as written and every file there at its
        size (a store that acknowledged a put it lost)."""
        if self.destination.read(self.manifest) != (self.staging / self.manifest).read_bytes():
            raise OSError(f"{self.destination.uri(self.manifest)} is not as it was put")
        for name in self._files():
            entry = self.destination.stat(name)
            size = (self.staging / name).stat().st_size
            if entry is None or entry.kind != "file" or entry.size != size:
                raise OSError(f"{self.destination.uri(name)} is not as it was put")

    def discard(self) -> None:
        """Removes the staging folder (every way out: done, abandoned, or a save that failed
        before its upload began)."""
        shutil.rmtree(self.staging, ignore_errors=True)
