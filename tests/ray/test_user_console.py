"""A new user's first hour through the real `rayacc` command, on a Ray it starts itself: train
(progress lines with ETA, LR, tokens/s and named validation metrics) and sample the trained GPT;
every line on the console is rayacc's or an error, never a record of Ray's loggers. (A sweep's
console, Tune's reporter silenced, is checked on the sweep of `tests/ray/test_plan_search.py`.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.services.cli import assert_only_rayaccs_lines

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.ray


def rayacc(tmp_path: Path, *argv: str, timeout: int = 400) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYACC_VERBOSE")}
    proc = subprocess.run(
        [sys.executable, "-m", "rayacc.cli", *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_train_the_shakespeare_job_watch_it_and_sample_it(tmp_path):
    proc = rayacc(
        tmp_path,
        "train",
        "-c",
        str(ROOT / "jobs/shakespeare.yaml"),
        "train.max_steps=12",
        "train.val_every_steps=5",
        "train.checkpoint_every_steps=null",
        "run.name=bard",
        "model.n_layer=2",
        # a CPU has no known peak: configured, the GPT's MFU shows (PaLM's FLOPs per token)
        "train.peak_tflops=0.05",
    )
    assert_only_rayaccs_lines(proc)
    out = proc.stdout
    assert "strategy DDP" in out and "precision fp32" in out and "activation checkpointing" in out
    lines = [line for line in out.splitlines() if re.match(r"\s+step \d+/12 ", line)]
    assert lines, out
    for line in lines:
        # no ETA until two steps give a rate
        assert re.search(r"\d+:\d\d elapsed  (ETA \d+:\d\d  )?loss \S+  lr \S+  ", line), line
        assert "samples/s" in line and "tokens/s" in line, line
        assert re.search(r"  MFU \d+\.\d%", line), line
    with_eta = [line for line in lines if "ETA " in line]
    assert with_eta, lines
    validated = [line for line in lines if "val_loss" in line]
    assert [int(re.search(r"step (\d+)/", line).group(1)) for line in validated] == [5, 10, 12]
    assert "rayacc sample" in out  # the summary says how
    summary = next(line for line in out.splitlines() if "per step (median" in line)
    assert re.search(r"MFU \d+\.\d%", summary), summary
    # where the wall time went: one group, nothing restarted or recomputed
    goodput = re.search(
        r"goodput <?([\d.]+)%: training ([\d.]+) s of [\d.]+ s \((.*)\); (\d+) steps", out
    )
    assert goodput and 0 < float(goodput.group(1)) < 100, out[-2000:]
    assert "start-up" in goodput.group(3) and "restarts" not in goodput.group(3)
    assert goodput.group(4) == "0"

    # the finished run resumed as it was started (its overrides recorded): nothing to do,
    # said at once (no Ray started); the job file alone would have trained it on to 300 steps
    resumed = rayacc(tmp_path, "train", "-c", str(ROOT / "jobs/shakespeare.yaml"), "--resume",
                     "run.name=bard")  # fmt: skip
    assert "kept from the run's start: train.max_steps=12" in resumed.stdout, resumed.stdout
    assert "is finished: its checkpoint at step 12 is the last of its 12 steps" in resumed.stdout
    assert "step 1/" not in resumed.stdout

    sampled = rayacc(
        tmp_path, "sample", "bard", "--prompt", "The ", "--tokens", "40", "--seed", "7"
    )
    assert_only_rayaccs_lines(sampled)
    assert sampled.stdout.startswith("The ")
    text = sampled.stdout[len("The ") : -1]
    assert len(text) == 40 and sampled.stdout.endswith("\n")
    checkpoint = next((tmp_path / "rayacc_runs" / "bard").glob("checkpoint_step*"))
    import json

    vocab = json.loads((checkpoint / "vocab.json").read_text())
    assert vocab["kind"] == "chars" and set(text) <= set(vocab["chars"])
    assert "40 tokens from" in sampled.stderr
