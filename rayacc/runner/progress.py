"""Events and per-step records from rank 0 to the driver, without making rank 0 wait."""

from __future__ import annotations

import time
from typing import Any

import ray

__all__ = ["Outbox", "ProgressBuffer"]


@ray.remote(num_cpus=0)
class ProgressBuffer:
    """Rank 0 calls `push.remote(items)` and does not wait (calls from one caller run in
    order); the driver drains the items it has not seen."""

    def __init__(self) -> None:
        self._items: list[Any] = []

    def push(self, items: list[Any]) -> None:
        self._items.extend(items)

    def drain(self) -> list[Any]:
        items, self._items = self._items, []
        return items


class Outbox:
    """Rank 0's events and records for the driver, sent in batches at most every `interval_s`:
    one actor call costs about a millisecond, too much to pay on every step of a fast model.
    Without a buffer (ranks other than 0) it holds nothing."""

    def __init__(self, buffer, interval_s: float = 0.5):
        self.buffer = buffer
        self.interval_s = interval_s
        self.pending: list[Any] = []
        self.last_sent = time.perf_counter()
        self.cost_s = 0.0

    def send(self, item: Any) -> None:
        if self.buffer is None:
            return
        self.pending.append(item)
        if time.perf_counter() - self.last_sent >= self.interval_s:
            self.flush()

    def flush(self) -> None:
        if self.buffer is None or not self.pending:
            return
        t = time.perf_counter()
        self.buffer.push.remote(self.pending)
        self.pending = []
        self.last_sent = time.perf_counter()
        self.cost_s += self.last_sent - t
