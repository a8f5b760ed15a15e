"""The environment variables rayacc reads, named once."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE", "VERBOSE", "cache_dir", "verbose"]

VERBOSE = "RAYACC_VERBOSE"
"""`1`: show Ray's own log records (INFO, WARNING), its worker logs and Ray Data's progress
on the console."""
CACHE = "RAYACC_CACHE"
"""Where bundled datasets are prepared (default ~/.cache/rayacc); `data.cache_dir` wins."""


def verbose() -> bool:
    return os.environ.get(VERBOSE) == "1"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE, Path.home() / ".cache" / "rayacc"))
