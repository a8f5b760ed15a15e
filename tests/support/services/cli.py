"""The `rayacc` command, in this process (checks that end before any worker starts) or as a
process of its own (where the process itself is what a test proves)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.support import ROOT
from tests.support.services.counts import ray_sessions

RAY_RECORD = re.compile(r"\t(DEBUG|INFO|WARNING) \S+:\d+ -- ")
"""A record as Ray's console handlers format it (Ray Core, Ray Data, Train, Tune)."""
NOT_OURS = (
    "Token authentication",
    "tensorboard",
    "View detailed results",
    "Configuration for experiment",
    "Trial status",
    "Progress bars disabled",
)
"""Lines Ray, Tune or their reporters print that a `rayacc` console must not show."""


def assert_only_rayaccs_lines(proc: subprocess.CompletedProcess) -> None:
    """Every line a `rayacc` process printed is rayacc's or an error, never a record of Ray's
    loggers or Tune's reporter."""
    console = proc.stdout + proc.stderr
    records = [line for line in console.splitlines() if RAY_RECORD.search(line)]
    assert not records, records
    for words in NOT_OURS:
        assert words not in console, console


@dataclass(frozen=True)
class Ran:
    code: int
    out: str
    err: str


def rayacc_here(argv: list[str], capsys, monkeypatch, **env: str) -> Ran:
    """`rayacc ARGV` through `rayacc.cli.main` in this process, with `env` set; its exit code
    and what it printed. Fails if it started a local Ray."""
    from rayacc.cli import main

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    capsys.readouterr()
    before = ray_sessions()
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own errors
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    assert ray_sessions() == before, f"rayacc {' '.join(argv)} started a Ray:\n{out}{err}"
    return Ran(code, out, err)


def rayacc_process(
    argv: list[str], cwd: Path = ROOT, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess:
    """`rayacc ARGV` as the command a user runs: a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "rayacc.cli", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=dict(os.environ, **env),
        timeout=timeout,
    )
