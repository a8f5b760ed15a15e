"""One writer per run: the lease a live driver holds on its run's folder.

The driver writes `rayacc_lease.json` (its host, pid, heartbeat time and a token of its own)
through the storage seam, whole (never a torn file a reader takes for no lease), and beats every
`HEARTBEAT_S`, each beat first checking that the lease is still its own: a driver that finds
its lease taken stops its run. The workers carry the token; a rank puts a checkpoint's manifest
(commits its part) only while the lease is its driver's and its heartbeat is at most
`COMMIT_FRESH_S` old, so the workers of a driver that died stop committing before anyone can
take the lease: another host's lease expires `LEASE_TTL_S` after its last heartbeat, one of a
driver of this host whose process is gone after `DEAD_HOLDER_S`. (Heartbeats are wall-clock
times: the nodes' clocks must agree to within a few seconds, as NTP keeps them.)
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from rayacc.checkpoint.storage import open_storage
from rayacc.data.common import DataError

__all__ = [
    "COMMIT_FRESH_S",
    "DEAD_HOLDER_S",
    "HEARTBEAT_S",
    "LEASE",
    "LEASE_TTL_S",
    "Lease",
    "LeaseLost",
    "RunLease",
    "check_lease",
    "read_lease",
]

log = logging.getLogger(__name__)

LEASE = "rayacc_lease.json"
"""In the run's folder while a driver writes the run: its host, pid, heartbeat and token."""
HEARTBEAT_S = 5.0
COMMIT_FRESH_S = 15.0
"""A rank commits a checkpoint only while its driver's heartbeat is at most this old (two
beats may fail in a row)."""
DEAD_HOLDER_S = 20.0
"""A lease of a driver of this host whose process is gone is free this long after its last
heartbeat: its workers stopped committing before."""
LEASE_TTL_S = 60.0
"""A lease whose heartbeat is older than this holds the run no more (its driver was killed, or
cut off from the storage)."""


class LeaseLost(RuntimeError):
    """The run's lease is not (or no longer) this driver's: its workers stop writing."""


def process_alive(pid: int) -> bool:
    """Whether a process of this host with that pid exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


@dataclass(frozen=True)
class Lease:
    """A driver's claim on a run: while its heartbeat is fresh no other driver writes it."""

    host: str
    pid: int
    heartbeat: float
    token: str

    def age(self) -> float:
        return max(0.0, time.time() - self.heartbeat)

    def holder_gone(self) -> bool:
        """Its driver is of this host and its process is gone."""
        return self.host == socket.gethostname() and not process_alive(self.pid)

    def live(self) -> bool:
        age = self.age()
        if age > LEASE_TTL_S:
            return False
        return not (age > DEAD_HOLDER_S and self.holder_gone())

    def driver_lives(self) -> bool:
        """A live driver holds the run (a gone one's lease, not yet free, is waited for by the
        next driver's `take`, not refused)."""
        return self.live() and not self.holder_gone()

    def free_in(self) -> float | None:
        """Seconds until a gone holder's lease is free (None: its holder lives, or another
        host's: it lasts until its heartbeats stop)."""
        return max(0.0, DEAD_HOLDER_S - self.age()) if self.holder_gone() else None

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, heartbeat {self.age():.0f} s ago"


def read_lease(storage: str, name: str) -> Lease | None:
    """The run's lease; none there, or not one rayacc writes: None (no claim)."""
    text = open_storage(storage).child(name).read(LEASE)
    try:
        raw = json.loads(text) if text else None
        return Lease(str(raw["host"]), int(raw["pid"]), float(raw["heartbeat"]), str(raw["token"]))
    except (ValueError, KeyError, TypeError):
        return None


def check_lease(storage: str, name: str, token: str) -> None:
    """That the run's lease is the one `token` names and its heartbeat fresh: what a rank
    checks before it commits a checkpoint. LeaseLost otherwise."""
    held = read_lease(storage, name)
    if held is None or held.token != token:
        who = held.describe() if held else "nobody"
        raise LeaseLost(
            f"run {name!r}'s lease is no longer this run's driver's (held by {who}): another "
            "driver writes the run now, so this group stops writing it"
        )
    if held.age() > COMMIT_FRESH_S:
        raise LeaseLost(
            f"run {name!r}'s driver has not renewed its lease for {held.age():.0f} s (gone, "
            f"or cut off from the storage; more than {COMMIT_FRESH_S:.0f} s): this group "
            "stops writing the run before another driver may take it"
        )


def held_message(name: str, storage: str, held: Lease | None) -> str:
    who = held.describe() if held is not None else "another driver"
    return (
        f"run {name!r} in {storage} is being written by a live driver ({who}); two drivers "
        "would write one folder and one MLflow run. Fix: wait for it to end (`rayacc runs` "
        f"shows it running), stop it, or resume another run; a lease a killed driver left "
        f"expires {LEASE_TTL_S:.0f} s after its last heartbeat"
    )


class RunLease:
    """The lease this driver holds on its run for the fit's length: taken before the worker
    group starts (refused while another live driver holds it; waited for while a driver of
    this host that is gone still holds it), beaten by a thread, removed when the fit ends.
    `lost` says why it is no longer held (None while it is)."""

    def __init__(self, storage: str, name: str, on_lost: Callable[[str], None] | None = None):
        self.storage, self.name = storage, name
        self.run = open_storage(storage).child(name)
        self.token = uuid.uuid4().hex
        self.lost: str | None = None
        self.on_lost = on_lost
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self) -> None:
        lease = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "heartbeat": time.time(),
            "token": self.token,
        }
        self.run.put(LEASE, json.dumps(lease).encode())

    def take(self) -> RunLease:
        held = read_lease(self.storage, self.name)
        if held is not None and held.token != self.token and held.live():
            wait = held.free_in()
            if wait is None:
                raise DataError(held_message(self.name, self.storage, held))
            log.warning(
                "run %r: the driver that held it (pid %d) is gone; waiting %.0f s for its "
                "workers to stop writing",
                self.name,
                held.pid,
                wait,
            )
            time.sleep(wait + 0.1)
        self._write()
        # two drivers that read "free" at once: the one whose lease stands goes on
        time.sleep(0.05)
        mine = read_lease(self.storage, self.name)
        if mine is None or mine.token != self.token:
            raise DataError(held_message(self.name, self.storage, mine))
        self._thread = threading.Thread(target=self._beat, name="rayacc-lease", daemon=True)
        self._thread.start()
        return self

    def beat(self) -> None:
        """One heartbeat: the lease checked to be this driver's, then renewed."""
        held = read_lease(self.storage, self.name)
        if held is None or held.token != self.token:
            who = held.describe() if held else "nobody: its file was removed"
            self.lost = (
                f"run {self.name!r}'s lease was taken while this driver ran it (now held by "
                f"{who}), so this driver stops: two writers would break the run's "
                "checkpoints. Fix: let one driver run it; resume it with --resume once the "
                "other has ended"
            )
            self._stop.set()
            if self.on_lost is not None:
                self.on_lost(self.lost)
            return
        self._write()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.beat()
            except OSError as exc:
                # storage away for a moment: the next beat tries again; the workers stop
                # committing if it stays away
                log.debug("lease heartbeat failed: %s", exc)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.lost is not None:
            return
        held = read_lease(self.storage, self.name)
        if held is not None and held.token == self.token:
            self.run.delete(LEASE)
