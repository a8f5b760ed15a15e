"""Rank 0's copy of the run's lineage: every step record so far, which each checkpoint
carries (`history.jsonl`)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["StepLog"]


class StepLog:
    """Every step record so far, spooled to a local file (a long run's records stay off the
    heap); a checkpoint takes a copy. The file has no name (an anonymous temporary file):
    nothing is left in the temp folder however the process ends, a group ended by a resize or
    a failure included."""

    def __init__(self) -> None:
        # open for the run's length
        self._file = tempfile.TemporaryFile("w+", prefix="rayacc-history-")  # noqa: SIM115

    def append(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, default=str) + "\n")

    def load(self, path: Path) -> None:
        """Starts from a checkpoint's lineage (none: an empty one)."""
        self._file.seek(0)
        self._file.truncate()
        if path.is_file():
            with open(path) as saved:
                shutil.copyfileobj(saved, self._file)

    def copy_to(self, path: Path) -> None:
        self._file.flush()
        self._file.seek(0)
        with open(path, "w") as copy:
            shutil.copyfileobj(self._file, copy)
        self._file.seek(0, os.SEEK_END)
