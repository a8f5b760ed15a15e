"""Per-step records from rank 0 to the driver, without making rank 0 wait."""

from __future__ import annotations

from typing import Any

import ray


@ray.remote(num_cpus=0)
class ProgressBuffer:
    """Rank 0 calls `push.remote(records)` and does not wait (calls from one caller run in
    order); the driver drains the records it has not seen."""

    def __init__(self) -> None:
        self._records: list[dict[str, Any]] = []

    def push(self, records: list[dict[str, Any]]) -> None:
        self._records.extend(records)

    def drain(self) -> list[dict[str, Any]]:
        records, self._records = self._records, []
        return records
