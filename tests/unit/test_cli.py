"""User mistakes exit 2 with a message naming the field or file and the fix, and no traceback,
before Ray starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[2]
DIGITS_JOB = str(ROOT / "jobs" / "digits.yaml")


def rayacc(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, RAYACC_CACHE=str(cache), RAY_ADDRESS="")
    return subprocess.run(
        [sys.executable, "-m", "rayacc.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cli-cache")


def bad_parquet(tmp_path: Path) -> str:
    path = tmp_path / "wrong_columns.parquet"
    pq.write_table(pa.table({"pixels": [[0.0, 1.0]], "y": [1]}), path)
    return str(path)


CASES = [
    (
        lambda tmp: ["train", "-c", str(tmp / "missing.yaml")],
        ["config file not found", "missing.yaml"],
    ),
    (
        lambda tmp: ["train", "-c", DIGITS_JOB, f"data.source={bad_parquet(tmp)}"],
        ["wrong_columns.parquet", "match no format", "`features`", "`tokens`"],
    ),
    (
        lambda tmp: ["train", "-c", DIGITS_JOB, "data.source=/nowhere/data.parquet"],
        ["/nowhere/data.parquet", "no such file"],
    ),
    (
        lambda tmp: ["train", "-c", DIGITS_JOB, "batch.micro_batch_size=30"],
        ["batch.micro_batch_size", "does not divide", "Fix: set batch.micro_batch_size to"],
    ),
    (
        lambda tmp: ["train", "-c", DIGITS_JOB, "model.name=transformer"],
        ["model.name", "'mlp', 'gpt' or 'factory'"],
    ),
    (
        lambda tmp: [
            "train",
            "-c",
            DIGITS_JOB,
            "model.name=factory",
            "model.factory=nosuchpkg.models:build",
        ],
        ["model.factory", "cannot import 'nosuchpkg.models'"],
    ),
    (
        lambda tmp: ["train", "-c", DIGITS_JOB, "model.name=gpt"],
        ["model.name=gpt needs token data", "Fix: use model.name=mlp"],
    ),
    (
        lambda tmp: ["train", "-c", DIGITS_JOB, "optim.lr_scalling=sqrt"],
        ["optim.lr_scalling: unknown key", "did you mean 'optim.lr_scaling'"],
    ),
]


@pytest.mark.parametrize(
    ("argv", "expected"),
    CASES,
    ids=[
        "missing-file",
        "wrong-columns",
        "missing-parquet",
        "indivisible-batch",
        "unknown-model",
        "factory-import",
        "model-data-mismatch",
        "unknown-key",
    ],
)
def test_user_errors_exit_2_with_message(tmp_path, cache, argv, expected):
    proc = rayacc(*argv(tmp_path), cache=cache)
    assert proc.returncode == 2, proc.stderr
    for text in expected:
        assert text in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Ray" not in proc.stderr + proc.stdout, "the error must come before Ray starts"


def test_plan_prints_the_resolved_batch(cache):
    proc = rayacc("plan", "-c", DIGITS_JOB, "scaling.num_workers=4", cache=cache)
    assert proc.returncode == 0, proc.stderr
    assert "global batch 256 = micro 32 × accum 2 × workers 4" in proc.stdout
    assert "effective LR 0.006 = 0.003 × linear(256/128)" in proc.stdout


def test_plan_lists_memory_per_rank_for_each_strategy(cache):
    proc = rayacc("plan", "-c", DIGITS_JOB, "--memory", "scaling.num_workers=4", cache=cache)
    assert proc.returncode == 0, proc.stderr
    assert "26,122 parameters, fp32, 4 workers" in proc.stdout, proc.stdout
    rows = {
        line.split("  ")[1].strip(): [float(v) for v in line.split()[-4:]]
        for line in proc.stdout.splitlines()
        if line.startswith("  ddp") or line.startswith("  fsdp")
    }
    ddp, every, end = rows["ddp"], rows["fsdp every_micro_step"], rows["fsdp window_end"]
    # AdamW: two slots; fsdp holds a quarter of each at 4 workers, window_end whole gradients
    assert ddp[2] == pytest.approx(2 * ddp[0], abs=0.1)
    assert every[:3] == pytest.approx([d / 4 for d in ddp[:3]], abs=0.1)
    assert end[1] == ddp[1] and ddp[3] == every[3] > 0


def test_data_prepare(cache):
    proc = rayacc("data", "prepare", "digits", cache=cache)
    assert proc.returncode == 0, proc.stderr
    assert "digits: 1797 rows (classification)" in proc.stdout
    assert (cache / "digits" / "digits.parquet").is_file()


def test_plan_lists_the_worker_counts_of_an_elastic_run(cache):
    proc = rayacc("plan", "-c", DIGITS_JOB, "scaling.num_workers=[1,4]", cache=cache)
    assert proc.returncode == 0, proc.stderr
    assert "elastic run [1, 4] (keep_global_batch)" in proc.stdout
    assert "1 → micro 32 × accum 8, global 256" in proc.stdout
    assert "Not at 3 worker(s): the global batch 256 cannot be kept at 3 workers" in proc.stdout
