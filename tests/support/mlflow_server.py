"""A real `mlflow server` for tests: started on a free port over a sqlite store, killed by its
process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from rayacc.tracking.sqlite_store import prepare_sqlite_store
from tests.support.counts import count

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, db: Path) -> subprocess.Popen:
    # a new store is a copy of the cached empty one: MLflow's migrations of a new database
    # take about 30 s of a first start on 2 cores
    prepare_sqlite_store(f"sqlite:///{db}")
    count("MLflow servers")
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
