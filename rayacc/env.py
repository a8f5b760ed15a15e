"""What rayacc reads of its process's environment: the variables, named once, and the umask
files it writes for others take their modes from."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "CACHE",
    "FIELD_VARIABLES",
    "FLAG_VARIABLES",
    "OVERRIDES",
    "OWN_VARIABLES",
    "VARIABLES",
    "VERBOSE",
    "cache_dir",
    "plain_ray_lines",
    "umask_modes",
    "verbose",
]

VERBOSE = "RAYACC_VERBOSE"
"""`1`: show Ray's own log records (INFO, WARNING), its worker logs and Ray Data's progress
on the console."""
CACHE = "RAYACC_CACHE"
"""Where bundled datasets are prepared (default ~/.cache/rayacc); `data.cache_dir` wins."""
OVERRIDES = "RAYACC_OVERRIDES"
"""A JSON list of overrides `rayacc train` adds to its command line's: how a submitted job
receives the ones that carry credentials (`driver/jobs.py`)."""


def verbose() -> bool:
    return os.environ.get(VERBOSE) == "1"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE, Path.home() / ".cache" / "rayacc"))


def plain_ray_lines() -> None:
    """Ray colours the prefix of the lines it relays (`(raylet)`, a worker's pid) whatever the
    console: in a file or a pipe they arrive as raw escape codes. Off there, before Ray
    starts, unless the user set Ray's own `RAY_COLOR_PREFIX`."""
    import sys

    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


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
OWN_VARIABLES = {
    VERBOSE: "the switch that shows Ray's records on the console",
    CACHE: "rayacc's cache folder",
    OVERRIDES: "a submitted job's overrides",
}
"""rayacc's own variables, and what each holds."""
VARIABLES = {**FIELD_VARIABLES, **FLAG_VARIABLES, **OWN_VARIABLES}
"""Every variable rayacc reads and what it stands for: each is checked as that field, flag or
value is when a command starts (`driver.arguments.environment_problems`), exit 2 naming it."""


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (another thread
    creating a file meanwhile would otherwise get the wrong mode)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def umask_modes(path: Path) -> None:
    """Gives `path` (a file, or a folder and everything in it) the modes `open()` and `mkdir()`
    give under the umask: a file staged by `tempfile` (0600, a folder 0700) and renamed into
    place would keep another user (a serving process, MLflow's UI) out of what is theirs."""
    mask = _umask()
    entries = [path, *path.rglob("*")] if path.is_dir() else [path]
    for entry in entries:
        if not entry.is_symlink():
            entry.chmod((0o777 if entry.is_dir() else 0o666) & ~mask)
