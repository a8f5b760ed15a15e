"""Clusters of the multi-node tests, on loopback (cluster/local.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import LEAN_RAY_TRAIN, ROOT
from tests.support.services.cluster import local

# each cluster's ports start here, a node's in a block of 200 above them (cluster/local.sh)
LOOPBACK_PORT = "29379"
OWN_PORT = "32379"


def cluster_env(state: Path, port: str, **extra: str) -> dict:
    env = dict(
        os.environ,
        RAYACC_LOCAL_DIR=str(state),
        RAYACC_LOCAL_PORT=port,
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        **extra,
    )
    env.pop("RAY_ADDRESS", None)
    # Ray Train as users run it: the preemption watcher is what a reclaim needs
    for name in LEAN_RAY_TRAIN:
        env.pop(name, None)
    return env


def down(env: dict) -> None:
    subprocess.run(
        ["bash", "cluster/local.sh", "down"], cwd=ROOT, env=env, capture_output=True, timeout=120
    )


@pytest.fixture(scope="session")
def loopback(tmp_path_factory):
    """One Ray head on loopback for the elastic and spot runs (a cluster's start and stop cost
    about a minute on 2 cores): each test adds the worker nodes it needs and leaves the head
    alone. No MLflow server: the runs record into sqlite stores of their own."""
    state = tmp_path_factory.mktemp("loopback") / "cluster"
    env = cluster_env(state, LOOPBACK_PORT, RAYACC_LOCAL_MLFLOW="0")
    local("up", "0", env=env)
    env["RAYACC_CLUSTER_ENV"] = str(state / "env")
    yield env
    down(env)


@pytest.fixture
def cluster(tmp_path):
    """A cluster of the test's own (the autoscaling one is of another kind), stopped after it."""
    env = cluster_env(tmp_path / "cluster", OWN_PORT)
    yield env
    down(env)
