"""Goodput: where a fit's wall time went, from the events and step records as they arrive on
the driver (so each boundary is known to about the outbox's half second), in categories close
to those of Google's goodput measurement:

More: docs/design.md, "Notes from the code" (observe/goodput.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rayacc.observe.events import (
    Checkpointed,
    CheckpointWaited,
    Event,
    PreemptionNotice,
    ReclaimStandby,
    RunObserver,
    RunStarted,
)

__all__ = ["PARTS", "Goodput", "Recoveries", "Recovery", "describe"]

PARTS = {
    "training_s": "training",
    "startup_s": "start-up",
    "group_start_s": "Ray and worker-group start",
    "restore_s": "checkpoint restore",
    "data_s": "data waits",
    "validation_s": "validation",
    "checkpoint_s": "checkpoints",
    "checkpoint_wait_s": "checkpoint waits",
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
        self.checkpoint_wait_s = 0.0
        self.recomputed_s = 0.0
        self.recomputed_steps = 0
        self.groups = 0

    def on_event(self, event: Event) -> None:
        now = self.clock()
        if isinstance(event, RunStarted):
            # read with the group's first steps at times: their time is theirs, not the start's
            now = now if event.announced_at is None else min(now, event.announced_at)
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
                step_s, _, validation_s = self.steps.pop(step)
                self.recomputed_s += step_s + validation_s
                self.recomputed_steps += 1
        elif isinstance(event, Checkpointed):
            waited = min(max(0.0, event.waited_s), event.seconds)
            self.checkpoint_s += event.seconds - waited
            self.checkpoint_wait_s += waited
        elif isinstance(event, CheckpointWaited):
            self.checkpoint_wait_s += event.seconds
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
            "checkpoint_wait_s": self.checkpoint_wait_s,
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


@dataclass(frozen=True)
class Recovery:
    """A worker group that followed another: from the end of the one before to training
    again. Times are time.time() seconds; the group before ended at the reclaim's deadline (as
    the run brought it forward) when a notice came, else with its last item."""

    step: int
    """The step the new group started from."""
    ended_at: float
    training_at: float
    """The new group's first step (as the driver received it)."""
    group_start_s: float
    """From the new group's processes starting (no earlier than the end of the one before) to
    its first step: what a start costs, the rest of the recovery is waiting for it."""
    recomputed: int
    notice_to_deadline_s: float | None = None

    @property
    def back_s(self) -> float:
        return self.training_at - self.ended_at

    def console_line(self) -> str:
        tail = (
            f"training again {self.back_s:.1f} s (group start {self.group_start_s:.1f} s), "
            f"steps recomputed {self.recomputed}"
        )
        if self.notice_to_deadline_s is None:
            return f"back to training at step {self.step + 1}: group end → {tail}"
        return f"reclaim: notice → deadline {self.notice_to_deadline_s:.1f} s, deadline → {tail}"


class Recoveries(RunObserver):
    """Each recovery of a fit, known at the new group's first step: `on_step` returns it (the
    console prints it there), `done` keeps them."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.groups = 0
        self.last_seen: float | None = None
        self.top_step = 0
        self.noticed: tuple[float, float] | None = None
        """(when the notice arrived, the deadline as it stands)."""
        self.pending: tuple[RunStarted, float, float | None] | None = None
        self.done: list[Recovery] = []

    def on_event(self, event: Event) -> Recovery | None:
        now = self.clock()
        if isinstance(event, PreemptionNotice):
            deadline = event.deadline_at or now + event.seconds_left
            self.noticed = (now, deadline)
        elif isinstance(event, ReclaimStandby) and self.noticed and event.deadline_at:
            self.noticed = (self.noticed[0], event.deadline_at)
        elif isinstance(event, RunStarted):
            if self.groups and self.last_seen is not None:
                ended = self.noticed[1] if self.noticed else self.last_seen
                notice_s = self.noticed[1] - self.noticed[0] if self.noticed else None
                self.pending = (event, ended, notice_s)
            self.groups += 1
            self.noticed = None
        self.last_seen = now
        return None

    def on_step(self, record: dict[str, Any]) -> Recovery | None:
        now = self.clock()
        self.last_seen = now
        recovery = None
        if self.pending is not None:
            started, ended, notice_s = self.pending
            began = max(started.process_started_at or ended, ended)
            recovery = Recovery(
                step=started.step,
                ended_at=ended,
                training_at=now,
                group_start_s=max(0.0, now - began),
                recomputed=max(0, self.top_step - started.step),
                notice_to_deadline_s=notice_s,
            )
            self.done.append(recovery)
            self.pending = None
        self.top_step = max(self.top_step, record["step"])
        return recovery


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
