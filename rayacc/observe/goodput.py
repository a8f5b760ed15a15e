"""Goodput: where a fit's wall time went, from the events and step records as they arrive on
the driver (so each boundary is known to about the outbox's half second), in categories close
to those of Google's goodput measurement:

- training: the productive part of the kept steps' time (`perf/step_time_s` less the data the
  step waited for);
- start-up: the driver's checks before Ray, and each rank's own set-up once its group started
  (building the model, opening its data, the micro-batch search);
- Ray and worker-group start: from the checks to the first group's train function (Ray's start
  or join, the controller, placement, the worker processes and their imports);
- checkpoint restore: loading the checkpoint a group starts from (`RunStarted.restore_s`);
- data waits: the part of the kept steps' time spent waiting for data;
- validation: the validations' time (`val/time_s` of a step record);
- checkpoints: what the ranks waited for their checkpoints (`Checkpointed`; with asynchronous
  checkpoints, the blocking part);
- recomputed: the step time of steps done again after a restart (an attempt no checkpoint
  kept): progress wasted by a disruption;
- restarts and resizes: from the last item of a group to the next group's `RunStarted`, less
  its restore (the failure or the resize, waiting for the reclaim after the last checkpoint,
  the new group): recovery;
- other: the rest (the gaps between epochs, handing records over, the end).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rayacc.observe.events import Checkpointed, Event, RunObserver, RunStarted

__all__ = ["PARTS", "Goodput", "describe"]

PARTS = {
    "training_s": "training",
    "startup_s": "start-up",
    "group_start_s": "Ray and worker-group start",
    "restore_s": "checkpoint restore",
    "data_s": "data waits",
    "validation_s": "validation",
    "checkpoint_s": "checkpoints",
    "recomputed_s": "recomputed",
    "restarts_s": "restarts and resizes",
    "other_s": "other",
}
"""`goodput/<key>` in MLflow → what the summary calls it."""


class Goodput(RunObserver):
    """`started`: when the fit was called; `checked`: when its checks were done and Ray's start
    (or join) began (None: the same moment)."""

    def __init__(
        self,
        started: float,
        clock: Callable[[], float] = time.time,
        checked: float | None = None,
    ):
        self.started, self.clock = started, clock
        self.checked = started if checked is None else checked
        self.last_seen: float | None = None
        self.steps: dict[int, tuple[float, float, float]] = {}
        """step → (step time, the part of it waiting for data, validation after it)."""
        self.startup_s = 0.0
        self.group_start_s = 0.0
        self.restore_s = 0.0
        self.restarts_s = 0.0
        self.checkpoint_s = 0.0
        self.recomputed_s = 0.0
        self.recomputed_steps = 0
        self.groups = 0

    def on_event(self, event: Event) -> None:
        now = self.clock()
        if isinstance(event, RunStarted):
            restore = max(0.0, event.restore_s)
            if self.groups == 0:
                total = max(0.0, now - self.started)
                entered = event.entered_at if event.entered_at is not None else self.checked
                group = min(max(0.0, entered - self.checked), total)
                self.restore_s += min(restore, total - group)
                self.group_start_s = group
                self.startup_s = max(0.0, total - group - restore)
            else:
                gap = max(0.0, now - (self.last_seen or now))
                self.restore_s += min(restore, gap)
                self.restarts_s += max(0.0, gap - restore)
            self.groups += 1
            # steps after the checkpoint this group starts from are done again
            for step in [s for s in self.steps if s > event.step]:
                self.recomputed_s += self.steps.pop(step)[0]
                self.recomputed_steps += 1
        elif isinstance(event, Checkpointed):
            self.checkpoint_s += event.seconds
        self.last_seen = now

    def on_step(self, record: dict[str, Any]) -> None:
        self.last_seen = self.clock()
        step_s = float(record.get("perf/step_time_s", 0.0))
        data_s = step_s * float(record.get("perf/data_wait_frac", 0.0))
        self.steps[record["step"]] = (step_s, data_s, float(record.get("val/time_s", 0.0)))

    def split(self, wall_s: float | None = None) -> dict[str, float]:
        """The parts (seconds), `fraction` (training / wall), `wall_s`, `restarts` (worker
        groups after the first) and `steps_recomputed`."""
        wall = wall_s if wall_s is not None else self.clock() - self.started
        data = sum(d for _, d, _ in self.steps.values())
        parts = {
            "training_s": sum(s for s, _, _ in self.steps.values()) - data,
            "startup_s": self.startup_s,
            "group_start_s": self.group_start_s,
            "restore_s": self.restore_s,
            "data_s": data,
            "validation_s": sum(v for _, _, v in self.steps.values()),
            "checkpoint_s": self.checkpoint_s,
            "recomputed_s": self.recomputed_s,
            "restarts_s": self.restarts_s,
        }
        parts["other_s"] = max(0.0, wall - sum(parts.values()))
        return {
            **parts,
            "wall_s": wall,
            "fraction": parts["training_s"] / wall if wall > 0 else 0.0,
            "restarts": float(max(0, self.groups - 1)),
            "steps_recomputed": float(self.recomputed_steps),
        }


def percent(fraction: float) -> str:
    """A share as a percentage that never reads 0 % or 100 % when it is not: a short job's
    goodput is often under 1 % (start-up dominates), and "0 %" would say no training ran."""
    if fraction <= 0.0 or fraction >= 1.0:
        return f"{fraction:.0%}"
    if fraction < 0.001:
        return "<0.1%"
    if fraction < 0.1:
        return f"{fraction:.1%}"
    if fraction > 0.999:
        return ">99.9%"
    if fraction >= 0.995:
        return f"{fraction:.1%}"
    return f"{fraction:.0%}"


def describe(split: dict[str, float]) -> str:
    """One line for the console's summary."""
    parts = ", ".join(
        f"{name} {split[key]:.1f} s"
        for key, name in PARTS.items()
        if key != "training_s" and split.get(key, 0.0) >= 0.05
    )
    recomputed = int(split.get("steps_recomputed", 0))
    return (
        f"goodput {percent(split['fraction'])}: training {split['training_s']:.1f} s of "
        f"{split['wall_s']:.1f} s"
        + (f" ({parts})" if parts else "")
        + f"; {recomputed} step{'' if recomputed == 1 else 's'} recomputed"
    )
