"""A run's step metrics as its lineage. One training run is one MLflow run whatever its restarts:
the points an attempt logged past the checkpoint the next group starts from stay in the run
(MLflow cannot delete a point), marked by the tag `rayacc.discarded_steps`, and the steps done
again are logged anew. Whoever reads the run's history reads it through `lineage_points`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

__all__ = ["DISCARDED_TAG", "Discarded", "discarded_marks", "lineage_points"]

DISCARDED_TAG = "rayacc.discarded_steps"
_TAG_CHARS = 7000
"""Of the 8,000 characters a tag may hold (about 120 marks: the oldest go first)."""
_MARK = re.compile(r"steps (\d+)-(\d+) logged before ([0-9T:.+-]+)")


@dataclass(frozen=True)
class Discarded:
    """The points of steps `first`..`last` logged before `before_ms` (ms since the epoch: when
    the group that starts again from step `first - 1` announced itself) are no step of the
    lineage: an attempt that reached no checkpoint logged them."""

    first: int
    last: int
    before_ms: int

    def describe(self) -> str:
        seconds, ms = divmod(self.before_ms, 1000)
        at = datetime.fromtimestamp(seconds, tz=UTC).replace(microsecond=ms * 1000)
        when = at.isoformat(timespec="milliseconds")
        return f"steps {self.first}-{self.last} logged before {when}"

    def covers(self, step: int, timestamp_ms: int) -> bool:
        return self.first <= step <= self.last and timestamp_ms < self.before_ms


def discarded_marks(tags: dict[str, str]) -> list[Discarded]:
    """The marks a run's tags hold, oldest first."""
    return [
        Discarded(int(a), int(b), round(datetime.fromisoformat(at).timestamp() * 1000))
        for a, b, at in _MARK.findall(tags.get(DISCARDED_TAG) or "")
    ]


def marks_tag(marks: list[Discarded]) -> str:
    """The tag's value for `marks`: whole marks only, the newest kept when they exceed a tag."""
    text = ""
    for mark in reversed(marks):
        entry = mark.describe() + ("; " + text if text else "")
        if len(entry) > _TAG_CHARS:
            break
        text = entry
    return text


def lineage_points(client: Any, run: Any, key: str) -> list[Any]:
    """The points of `key` in `run` (an MLflow Run) that are its lineage, one per step (the
    latest), by step: the points the run's marks discard passed over."""
    marks = discarded_marks(run.data.tags)
    kept: dict[int, Any] = {}
    for m in client.get_metric_history(run.info.run_id, key):
        if any(d.covers(m.step, m.timestamp) for d in marks):
            continue
        if m.step not in kept or m.timestamp >= kept[m.step].timestamp:
            kept[m.step] = m
    return [kept[s] for s in sorted(kept)]
