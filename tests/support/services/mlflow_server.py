"""A real `mlflow server` for tests: started on a free port over a sqlite store, killed by its
process group; and a gate in front of it that a test closes to cut the server off."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from rayacc.tracking.sqlite_store import prepare_sqlite_store
from tests.support.services.counts import count

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
        # MLflow 3's job runner (seven huey consumer processes, each importing MLflow) serves
        # its GenAI jobs, which no test asks for: CPU-seconds of every start on 2 cores
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
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


class Gate:
    """A TCP relay on a port of its own in front of a running server. `close()` is the server
    gone, as a client sees it: every open connection reset, new ones refused; `open()` is the
    server back on the same address. (Killing and restarting a real `mlflow server` for each
    outage cost about 20 s of start a time on 2 cores; what a client meets is the same.)"""

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._stalls: list[float] = []
        self.open()

    def stall(self, *seconds: float) -> None:
        """The next connections (one per value) are taken and left unanswered for that many
        seconds, then closed: a server too busy to answer yet (one just started)."""
        with self._lock:
            self._stalls.extend(seconds)

    @property
    def is_open(self) -> bool:
        return self._listener is not None

    def open(self) -> None:
        with self._lock:
            if self._listener is not None:
                return
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(64)
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def close(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
        if listener is not None:
            _shut(listener)
        for conn in conns:
            _shut(conn)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                stall = self._stalls.pop(0) if self._stalls else None
            if stall is not None:
                threading.Timer(stall, _shut, (client,)).start()
                continue
            try:
                server = socket.create_connection(self.target)
            except OSError:
                _shut(client)
                continue
            with self._lock:
                if self._listener is not listener:
                    _shut(client)
                    _shut(server)
                    return
                self._conns |= {client, server}
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._conns -= {src, dst}
            _shut(src)
            _shut(dst)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
