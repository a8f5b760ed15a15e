"""Events and per-step records from rank 0 to the driver, without making rank 0 wait; and the
micro-batch sizes that ran out of memory, remembered across worker-group restarts."""

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
        self._out_of_memory: list[int] = []

    def push(self, items: list[Any]) -> None:
        self._items.extend(items)

    def drain(self) -> list[Any]:
        items, self._items = self._items, []
        return items

    def remember_out_of_memory(self, micro_batch_size: int) -> None:
        """A micro-batch size that ran out of memory in training: the worker group restarted
        after it searches below it (the buffer lives as long as the fit, across restarts)."""
        self._out_of_memory.append(micro_batch_size)

    def out_of_memory_sizes(self) -> list[int]:
        return list(self._out_of_memory)


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
