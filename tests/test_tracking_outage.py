"""A tracking server that goes away mid-run costs nothing but two lines: a real `mlflow server`
is killed while a fit runs and started again; the run ends well and every step is in the
server once."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from rayacc import TrainConfig
from rayacc.events import RunObserver
from rayacc.runner.driver import fit

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, db: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            str(BIN / "mlflow"),
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{db}",
        ],
        cwd=db.parent,  # its default artifact folder lands there
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError("mlflow server did not start")


@pytest.mark.ray
def test_a_server_killed_mid_run_and_restarted_loses_no_step(
    ray_local, tmp_path, capfd, monkeypatch
):
    # as the `rayacc` command sets them: the sink retries, MLflow's client does not
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    port, db = free_port(), tmp_path / "server.db"
    uri = f"http://127.0.0.1:{port}"
    server = {"proc": start_server(port, db)}
    steps = 30
    cfg = TrainConfig.from_dict(
        {
            "seed": 1,
            "model": {
                "name": "factory",
                "factory": "tests.slow_model:build",
                "kwargs": {"delay_s": 0.1},
            },
            "data": {"source": "digits", "val_fraction": 0.0},
            "batch": {"global_batch_size": 32, "micro_batch_size": 8},
            "optim": {"name": "sgd", "lr": 0.05},
            "train": {"max_steps": steps},
            "scaling": {"num_workers": 2, "cpus_per_worker": 0.5},
            "tracking": {"tracking_uri": uri, "experiment": "outage"},
            "run": {"storage_path": str(tmp_path / "runs")},
        }
    )
    restarted = threading.Event()

    class Outage(RunObserver):
        """Kills the server when step 3 arrives; starts it again (in the background) at 12."""

        def on_step(self, record):
            if record["step"] == 3 and server["proc"].poll() is None:
                os.killpg(server["proc"].pid, signal.SIGKILL)
                server["proc"].wait()
            if record["step"] == 12 and not restarted.is_set():
                restarted.set()
                threading.Thread(
                    target=lambda: server.update(proc=start_server(port, db)), daemon=True
                ).start()

    try:
        result = fit(cfg, observers=[Outage()])
        err = capfd.readouterr().err
        assert restarted.is_set()
        assert "unreachable" in err and "records are kept" in err, err
        assert "tracking server back after" in err, err
        assert "could not be written" not in err, err
        client = MlflowClient(uri)
        history = client.get_metric_history(result.mlflow_run_id, "train/loss")
        assert sorted(m.step for m in history) == list(range(1, steps + 1))
        assert client.get_run(result.mlflow_run_id).info.status == "FINISHED"
    finally:
        if server["proc"].poll() is None:
            os.killpg(server["proc"].pid, signal.SIGKILL)
