"""Helpers of the multi-node tests: cluster/local.sh, a job of the slow test model, the
`rayacc` command against the cluster, the run's record and the single-process reference."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
import yaml
from mlflow.tracking import MlflowClient

from rayacc import load_model
from rayacc.data.bundled import prepare_bundled
from rayacc.tracking.history import lineage_points
from tests.support import ROOT
from tests.support.services.counts import count


def local(*args: str, env: dict) -> subprocess.CompletedProcess:
    if args[0] in ("up", "autoscale"):
        count("clusters")
        if args[0] == "up" and env.get("RAYACC_LOCAL_MLFLOW", "1") != "0":
            count("MLflow servers")
    proc = subprocess.run(
        ["bash", "cluster/local.sh", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


SLOW_MODEL = "tests.support.models.slow_model:build"
"""The whole-stack cluster jobs' model (its forwards can be held at a step)."""


def job(tmp_path: Path, name: str, num_workers, rows: int = 256, **extra) -> Path:
    data = tmp_path / f"d{rows}.parquet"
    if not data.exists():
        pq.write_table(pq.read_table(prepare_bundled("digits")).slice(0, rows), data)
    spec = {
        "seed": 1,
        "model": {
            "name": "factory",
            "factory": SLOW_MODEL,
            "kwargs": {"delay_s": 0.05},
        },
        "data": {"source": str(data), "shuffle": False, "val_fraction": 0.0},
        "batch": {"global_batch_size": 32, "micro_batch_size": 4},
        "optim": {
            "name": "sgd",
            "lr": 0.05,
            "momentum": 0.9,
            "base_batch_size": 32,
            "schedule": "constant",
        },
        "train": {"max_steps": 16, "epochs": 2, "checkpoint_every_steps": 2},
        "scaling": {
            "num_workers": num_workers,
            "cpus_per_worker": 1,
            # one worker per node: Ray's elastic sizing counts resources, not placement
            "extra_resources": {"worker_slot": 1},
        },
        "tracking": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": name},
        "run": {"storage_path": str(tmp_path / name), "max_failures": 3},
    }
    for section, values in extra.items():
        spec.setdefault(section, {}).update(values)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def train(spec: Path, env: dict, cluster_env: Path, during=None) -> subprocess.CompletedProcess:
    addresses = dict(
        line.removeprefix("export ").split("=", 1)
        for line in cluster_env.read_text().splitlines()
        if line.strip()
    )
    run_env = dict(
        env,
        RAY_ADDRESS=addresses["RAYACC_GCS_ADDRESS"],
        RAY_AUTH_MODE="token",
        # (an elastic run hands Ray Train's controller a 10 s placement timeout of its own:
        # scaling.start_timeout_s)
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "rayacc.cli", "train", "-c", str(spec)],
        cwd=ROOT,
        env=run_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if during is not None:
        during()
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-5000:]
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def add_node(env: dict) -> int:
    """One more worker node on the cluster (cluster/local.sh add); its number."""
    out = local("add", env=env).stdout
    found = re.search(r"worker node (\d+) up", out)
    assert found, out
    return int(found.group(1))


def wait_for_slots(env: dict, slots: int, timeout_s: float = 120) -> None:
    """Until the cluster has exactly `slots` worker slots, all free: an elastic run starts at as
    many workers as there are free slots then, and one that starts smaller (a slot the last
    run's workers still hold, a node not yet counted) grows at its first resize check, redoing
    the steps before it."""
    until(env, "slots", f"{slots}/{slots} worker slots free", timeout_s)


def until(env: dict, what: str, want: str, timeout_s: float) -> None:
    """Until `cluster/local.sh WHAT` says `want`: polls the cheap `WHAT quick` (the autoscaler
    report, a curl) each second and confirms with the exact `WHAT` (a Ray driver, about 2
    CPU-seconds) once it agrees — the report can be a few seconds behind Ray."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = local(what, "quick", env=env).stdout.strip()
        if seen == want:
            seen = local(what, env=env).stdout.strip()
            if seen == want:
                return
        assert time.monotonic() < deadline, f"cluster/local.sh {what}: {seen}, not {want}"
        time.sleep(1)


def wait_for_checkpoint(storage: Path, step: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not list(storage.glob(f"*/checkpoint_step{step:08d}")):
        assert time.monotonic() < deadline, f"no checkpoint of step {step} in {storage}"
        time.sleep(0.5)


def weights(checkpoint: Path) -> torch.Tensor:
    """The weights of a checkpoint of `job`'s model (the factory this suite trusts)."""
    model = load_model(checkpoint, factory=SLOW_MODEL)
    return torch.cat([v.reshape(-1).double() for v in model.state_dict().values()])


def run_record(tmp_path: Path, name: str):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    # one run, whatever its restarts: its lineage passes over the steps no checkpoint kept
    (run,) = client.search_runs([client.get_experiment_by_name(name).experiment_id])

    def series(key):
        return [m.value for m in lineage_points(client, run, key)]

    return run, series


def final_checkpoint(tmp_path: Path, name: str, step: int = 16) -> Path:
    return sorted((tmp_path / name).glob(f"*/checkpoint_step{step:08d}"))[-1]


def hold(tmp_path: Path, name: str, **forwards_at_world: int) -> dict:
    """Model kwargs that stop the run's first group of each worker count (`w2=16`: 2 workers)
    in forward `forwards + 1` (per rank) until the resize the test causes ends it, so no step
    past that point runs at the old size."""
    holds = {int(w.removeprefix("w")): n for w, n in forwards_at_world.items()}
    held = str(tmp_path / f"{name}.held")
    return {"kwargs": {"delay_s": 0.05, "holds": holds, "held": held}}


def wait_then(tmp_path: Path, name: str, *actions) -> callable:
    """`actions`: (checkpoint step, what to do once the group is held past it)."""

    def during():
        for step, action in actions:
            wait_for_checkpoint(tmp_path / name, step)
            # the group is held in the next step by now; the controller registers the
            # checkpoint from the workers' reports, which it polls
            time.sleep(5)
            action()

    return during


def reference_weights(spec: Path, windows=None) -> torch.Tensor:
    """The job's optimizer steps in one process, each on its whole window (no shuffle, no
    validation split): the weights every elastic run of it must end with. `windows`: each
    step's (first row, rows, LR); by default `max_steps` windows of the global batch at
    `optim.lr` (window s of an epoch is rows 32s..32s+31)."""
    import numpy as np
    import torch.nn.functional as F

    from rayacc import TrainConfig, build_model
    from rayacc.data.sources import describe_dataset

    cfg = TrainConfig.from_yaml(spec)
    model = build_model(cfg, describe_dataset(cfg.data.source))
    table = pq.read_table(cfg.data.source)
    x = torch.tensor(np.stack(table["features"].to_numpy(zero_copy_only=False)))
    y = torch.tensor(table["label"].to_numpy())
    o, g = cfg.optim, cfg.batch.global_batch_size
    if windows is None:
        windows = [(step * g % len(y), g, o.lr) for step in range(cfg.train.max_steps)]
    if o.name == "adamw":
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay
        )
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum)
    for lo, rows, lr in windows:
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        F.cross_entropy(model(x[lo : lo + rows]), y[lo : lo + rows]).backward()
        optimizer.step()
    return torch.cat([v.reshape(-1).double() for v in model.state_dict().values()])


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def notice_outcomes(step: int) -> tuple[str, str]:
    """What the console and the `rayacc.preemptions` tag may say of a preemption notice at
    `step` when a checkpoint is written in time: which of the two correct outcomes happens is
    timing — the notice lands on a periodic checkpoint's step (nothing more to write) or
    between two (a checkpoint is written at the notice)."""
    console = (
        rf"preemption notice at step {step}: node \w+ \(ranks [01]\) is reclaimed in \d+ s; ("
        rf"checkpoint of step {step} written in [\d.]+ s; training goes on until just before "
        rf"the deadline|step {step} is checkpointed already; training goes on)"
    )
    tag = (
        rf"step {step}: node \w+ \(ranks [01]\), deadline in [\d.]+ s, "
        rf"(checkpoint [\d.]+ s, [\d.]+ s to spare|checkpoint of step {step} already written)"
    )
    return console, tag
