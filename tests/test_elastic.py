"""Elastic runs on a real multi-node Ray cluster on loopback (cluster/local.sh): a node leaves or
joins mid-run; the global batch, the effective LR and the data order carry on."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from mlflow.tracking import MlflowClient

from rayacc import load_model
from rayacc.data.sources import prepare_bundled

pytestmark = [pytest.mark.ray, pytest.mark.cluster]
ROOT = Path(__file__).resolve().parent.parent
PORT = "29379"


def local(*args: str, env: dict) -> subprocess.CompletedProcess:
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


@pytest.fixture
def cluster(tmp_path):
    env = dict(
        os.environ,
        RAYACC_LOCAL_DIR=str(tmp_path / "cluster"),
        RAYACC_LOCAL_PORT=PORT,
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    env.pop("RAY_ADDRESS", None)
    yield env
    subprocess.run(
        ["bash", "cluster/local.sh", "down"], cwd=ROOT, env=env, capture_output=True, timeout=120
    )


def job(tmp_path: Path, name: str, num_workers, **extra) -> Path:
    data = tmp_path / "d256.parquet"
    if not data.exists():
        pq.write_table(pq.read_table(prepare_bundled("digits")).slice(0, 256), data)
    spec = {
        "seed": 1,
        "model": {
            "name": "factory",
            "factory": "tests.slow_model:build",
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
        spec[section].update(values)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def train(spec: Path, env: dict, cluster_env: Path, during=None) -> subprocess.CompletedProcess:
    addresses = dict(
        line.removeprefix("export ").split("=", 1) for line in cluster_env.read_text().splitlines()
    )
    run_env = dict(env, RAY_ADDRESS=addresses["RAYACC_GCS_ADDRESS"], RAY_AUTH_MODE="token")
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


def wait_for_checkpoint(storage: Path, step: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not list(storage.glob(f"*/checkpoint_step{step:08d}")):
        assert time.monotonic() < deadline, f"no checkpoint of step {step} in {storage}"
        time.sleep(0.5)


def weights(checkpoint: Path) -> torch.Tensor:
    return torch.cat([v.reshape(-1).double() for v in load_model(checkpoint).state_dict().values()])


def run_record(tmp_path: Path, name: str):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name(name).experiment_id])

    def series(key):
        return [
            m.value
            for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        ]

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


def reference_weights(spec: Path) -> torch.Tensor:
    """The job's 16 optimizer steps in one process, each on its whole window of 32 rows (no
    shuffle, no validation split: window s of an epoch is rows 32s..32s+31): the weights every
    elastic run of it must end with."""
    import numpy as np
    import torch.nn.functional as F

    from rayacc import TrainConfig, build_model
    from rayacc.data.sources import describe_dataset

    cfg = TrainConfig.from_yaml(spec)
    model = build_model(cfg, describe_dataset(cfg.data.source))
    table = pq.read_table(cfg.data.source)
    x = torch.tensor(np.stack(table["features"].to_numpy(zero_copy_only=False)))
    y = torch.tensor(table["label"].to_numpy())
    o = cfg.optim
    optimizer = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum)
    g = cfg.batch.global_batch_size
    for step in range(cfg.train.max_steps):
        lo = step * g % len(y)
        optimizer.zero_grad()
        F.cross_entropy(model(x[lo : lo + g]), y[lo : lo + g]).backward()
        optimizer.step()
    return torch.cat([v.reshape(-1).double() for v in model.state_dict().values()])


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_node_leaves_and_joins_with_global_batch_and_lr_kept(tmp_path, cluster, record_equivalence):
    local("up", "1", env=cluster)
    env_file = tmp_path / "cluster" / "env"

    # the single-process full-batch run: what every size, and every change of size, must give
    reference = reference_weights(job(tmp_path, "fixed", 2))

    # 2 workers (accumulation 4 each) on 2 nodes; node 1 is lost in step 5: 1 worker
    # (accumulation 8) goes on from checkpoint 4, held in step 9 until a node joins: 2 workers
    # again from checkpoint 8
    out = train(
        job(
            tmp_path,
            "elastic",
            [1, 2],
            model=hold(tmp_path, "elastic", w2=16, w1=32),
            scaling={"resize_interval_s": 2},
        ),
        cluster,
        env_file,
        during=wait_then(
            tmp_path,
            "elastic",
            (4, lambda: local("remove", "1", env=cluster)),
            (8, lambda: local("add", env=cluster)),
        ),
    ).stdout
    assert "resize at step 4" in out and "workers 2 → 1" in out, out[-3000:]
    assert "resize at step 8" in out and "workers 1 → 2" in out, out[-3000:]
    run, series = run_record(tmp_path, "elastic")
    workers = series("scaling/num_workers")
    assert workers == [2] * 4 + [1] * 4 + [2] * 8, workers
    assert set(series("scaling/global_batch_size")) == {32}
    assert series("scaling/grad_accum_steps") == [4] * 4 + [8] * 4 + [4] * 8
    assert set(series("train/lr")) == {0.05}
    assert len(series("train/loss")) == 16, "optimizer steps are contiguous, none repeated"
    resizes = run.data.tags["rayacc.resizes"]
    assert "step 4: workers 2→1, accum 4→8, global 32→32" in resizes, resizes
    assert "step 8: workers 1→2, accum 8→4, global 32→32" in resizes, resizes
    err = rel_diff(weights(final_checkpoint(tmp_path, "elastic")), reference)
    record_equivalence("elastic: 2 → 1 → 2 workers at steps 4, 8 vs one process, full batch", err)
    assert err <= 1e-5, err

    # keep_micro_batch: accumulation stays 4, the global batch follows the workers (32 → 16)
    # and the LR follows the linear rule (0.05 → 0.025) over a 5-step re-warmup
    out = train(
        job(
            tmp_path,
            "micro",
            [1, 2],
            model=hold(tmp_path, "micro", w2=16),
            scaling={"resize_interval_s": 2, "on_resize": "keep_micro_batch"},
        ),
        cluster,
        env_file,
        during=wait_then(tmp_path, "micro", (4, lambda: local("remove", "2", env=cluster))),
    ).stdout
    assert "resize at step 4" in out and "workers 2 → 1" in out, out[-3000:]
    run, series = run_record(tmp_path, "micro")
    assert series("scaling/num_workers") == [2] * 4 + [1] * 12
    assert series("scaling/grad_accum_steps") == [4] * 16
    assert series("scaling/global_batch_size") == [32] * 4 + [16] * 12
    assert series("train/samples") == [32] * 4 + [16] * 12
    expected_lr = [0.05] * 4 + [0.05 - 0.025 * min(k, 5) / 5 for k in range(12)]
    assert series("train/lr") == pytest.approx(expected_lr, rel=1e-9), series("train/lr")
    assert "step 4: workers 2→1, accum 4→4, global 32→16" in run.data.tags["rayacc.resizes"]
