"""Goodput: where a fit's wall time went, from the events and step records as they arrive on
the driver (so each boundary is known to about the outbox's half second).

- training: the step time (`perf/step_time_s`) of the steps the run kept;
- start-up: from the call to the first worker group's `RunStarted` (checks, Ray, the group,
  restore, data);
- restarts and resizes: from the last item of a group to the next group's `RunStarted` (the
  failure or the resize, waiting for the reclaim after the last checkpoint, the new group);
- checkpoints: the ranks' checkpoint writes (`Checkpointed`);
- recomputed: the step time of steps done again after a restart (an attempt no checkpoint kept);
- other: the rest (validation, the gaps between epochs, handing records over, the end).
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
    "restarts_s": "restarts and resizes",
    "checkpoint_s": "checkpoints",
    "recomputed_s": "recomputed",
    "other_s": "other",
}
"""`goodput/<key>` in MLflow → what the summary calls it."""


class Goodput(RunObserver):
    def __init__(self, started: float, clock: Callable[[], float] = time.time):
        self.started, self.clock = started, clock
        self.last_seen: float | None = None
        self.step_s: dict[int, float] = {}
        self.startup_s = 0.0
        self.restarts_s = 0.0
        self.checkpoint_s = 0.0
        self.recomputed_s = 0.0
        self.recomputed_steps = 0
        self.groups = 0

    def on_event(self, event: Event) -> None:
        now = self.clock()
        if isinstance(event, RunStarted):
            if self.groups == 0:
                self.startup_s = now - self.started
            else:
                self.restarts_s += now - (self.last_seen or now)
            self.groups += 1
            # steps after the checkpoint this group starts from are done again
            for step in [s for s in self.step_s if s > event.step]:
                self.recomputed_s += self.step_s.pop(step)
                self.recomputed_steps += 1
        elif isinstance(event, Checkpointed):
            self.checkpoint_s += event.seconds
        self.last_seen = now

    def on_step(self, record: dict[str, Any]) -> None:
        self.last_seen = self.clock()
        self.step_s[record["step"]] = float(record.get("perf/step_time_s", 0.0))

    def split(self, wall_s: float | None = None) -> dict[str, float]:
        """The parts (seconds), `fraction` (training / wall), `wall_s`, `restarts` (worker
        groups after the first) and `steps_recomputed`."""
        wall = wall_s if wall_s is not None else self.clock() - self.started
        parts = {
            "training_s": sum(self.step_s.values()),
            "startup_s": self.startup_s,
            "restarts_s": self.restarts_s,
            "checkpoint_s": self.checkpoint_s,
            "recomputed_s": self.recomputed_s,
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
