"""bench/gpu_check.sh, the first GPU run's one command, end to end on CPU (--dry-run): the
script, `rayacc train` of jobs/gpu_gpt.yaml, bench/gpu_step.py and the job under FSDP all run
and pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.ray
def test_gpu_check_dry_run_passes_every_step(tmp_path, ray_address):
    # its `rayacc` and bench processes join the suite's Ray (on the GPU machine each starts
    # its own; that start is `tests/ray/test_user_console.py`'s to prove)
    env = dict(os.environ, RAY_ADDRESS=ray_address, PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = proc.stdout
    for check in (
        "rayacc train exits 0",
        "one worker on cpu",
        "auto micro-batch",
        "validation ran",
        "final checkpoint complete",
        "bench/gpu_step.py exits 0",
        "fsdp: rayacc train exits 0",
        "fsdp: final checkpoint sharded",
        "fsdp: bf16 + activation checkpointing + offload steps",
        "fsdp: mesh from the placement",
        "bench/planner.py ran",
        "planner: pick / best measured",
    ):
        line = next((row for row in table.splitlines() if row.startswith(check)), "")
        assert "PASS" in line, f"{check}: {line or 'missing'}\n{table}"
    assert "all passed (dry run on CPU)" in table
    # the tensor-parallel row needs two devices: said, not run, not failed
    tp = next((row for row in table.splitlines() if row.startswith("tp: ")), "")
    assert "SKIP" in tp and "needs 2 GPUs (0 here)" in tp, table
