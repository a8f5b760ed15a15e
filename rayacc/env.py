"""The environment variables rayacc reads, named once."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE", "FIELD_VARIABLES", "FLAG_VARIABLES", "VERBOSE", "cache_dir", "verbose"]

VERBOSE = "RAYACC_VERBOSE"
"""`1`: show Ray's own log records (INFO, WARNING), its worker logs and Ray Data's progress
on the console."""
CACHE = "RAYACC_CACHE"
"""Where bundled datasets are prepared (default ~/.cache/rayacc); `data.cache_dir` wins."""


def verbose() -> bool:
    return os.environ.get(VERBOSE) == "1"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE, Path.home() / ".cache" / "rayacc"))


FIELD_VARIABLES = {
    "MLFLOW_TRACKING_URI": "tracking.tracking_uri",
    "MLFLOW_EXPERIMENT_NAME": "tracking.experiment",
}
"""Variables that stand for a config field where the config leaves it null (MLflow's own): each
is checked as that field is (`config.schema.environment_issues`), a second door to the field
with the same lock."""
FLAG_VARIABLES = {"RAY_ADDRESS": "--address"}
"""Variables that stand for a command's flag where it is not given (Ray's): each is checked as
the flag is (`driver.arguments.address_problem`)."""
