"""Spot reclaims with notice: what the ranks do when a node of the group is drained for
preemption (docs/design.md, "Preemption").

Ray Train tells each worker of a drain on its own (its watcher marks every worker's context)
and agrees on one answer in `ray.train.get_preemption_info()`, a barrier that costs about
10 ms on two CPU workers — as much as a whole step of the default job. So the ranks do not call
it every window: each rank reads its own context (an attribute), raises the window's signal
when it holds a notice, and the signal reaches every rank with the window's counts
(`AccumulationStep(signal=...)`, no collective of its own). Only a window whose signal count is
non-zero makes every rank call the barrier, so all make the same calls.

More: docs/design.md, "Notes from the code" (worker/preemption.py).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rayacc.cluster import capacity
from rayacc.engine import all_gather_objects
from rayacc.observe.events import CheckpointWaited, PreemptionNotice, ReclaimStandby
from rayacc.worker.cadence import Cadence

__all__ = [
    "DEFAULT_DEADLINE_S",
    "CheckpointNow",
    "Decision",
    "LastCheckpoint",
    "Notice",
    "Phase",
    "PreemptionWatch",
    "Reclaim",
    "ray_notice_sources",
]

DEFAULT_DEADLINE_S = 120.0
"""Ray Train's own wait when a drain gives no deadline (its DEFAULT_PREEMPTION_DEADLINE_S)."""
END_AFTER_S = 1.0
"""The deadline rank 0 sets once the last checkpoint is written (a drain's deadline of 0 means
none)."""
STANDBY_GRACE_S = 60.0
"""How long past the deadline the ranks wait for the restart before they train on (a drain
can be cancelled; Ray Train then never ends the group)."""


@dataclass(frozen=True)
class Notice:
    """A preemption notice the ranks agreed on."""

    deadline: float
    """When the nodes go (time.time() seconds)."""
    deadline_given: bool
    nodes: tuple[str, ...]
    ranks: tuple[int, ...]

    @classmethod
    def of(cls, info: Any, now: float) -> Notice:
        """From Ray Train's PreemptionInfo (deadline_ms: epoch milliseconds, or None)."""
        given = info.deadline_ms is not None
        deadline = info.deadline_ms / 1000 if given else now + DEFAULT_DEADLINE_S
        return cls(
            deadline=deadline,
            deadline_given=given,
            nodes=tuple(info.preempted_node_ids),
            ranks=tuple(info.preempted_ranks),
        )


class Phase(enum.Enum):
    """Where a rank stands with a reclaim."""

    WATCHING = "watching"
    """No notice yet: a rank signals when its own context holds one."""
    NOTICED = "noticed"
    """A notice agreed and answered: training goes on, and a rank signals when one more window
    and the last checkpoint would no longer fit before the deadline."""
    ENDING = "ending"
    """The last checkpoint is written (or the run ended with it): the group ends."""
    OVER = "over"
    """This notice is done with: no checkpoint fitted, or the drain was cancelled."""


@dataclass(frozen=True)
class CheckpointNow:
    """A notice was agreed at this boundary: checkpoint now, unless none fits before the
    deadline."""

    notice: Notice


@dataclass(frozen=True)
class LastCheckpoint:
    """The deadline is near: the last checkpoint, then the group ends (or, when the run ends
    here anyway, nothing more)."""

    notice: Notice


Decision = CheckpointNow | LastCheckpoint | None
"""What a window boundary does about a reclaim, the same on every rank (taken from the
window's signal count, which every rank receives)."""


class PreemptionWatch:
    """One rank's side of a reclaim, a state machine over `Phase`. Per window the worker asks
    `signal()` before the step and hands the step's signal count to `after_window`, which moves
    the phase and returns the boundary's `Decision`.

    `local`: this rank's notice or None, read without a collective; `agree`: the notice every
    rank agrees on (a barrier; None while rank 0 has not been told yet); `clock`: time.time."""

    def __init__(
        self,
        local: Callable[[], Any],
        agree: Callable[[], Any],
        clock: Callable[[], float] = time.time,
        end_now: Callable[[Sequence[str]], None] | None = None,
        checkpoint_cost: Callable[[], float | None] = lambda: None,
    ):
        """`end_now(nodes)`: brings the reclaim of these nodes forward to now (None: the ranks
        wait for the deadline). `checkpoint_cost()`: a whole checkpoint's time as last measured
        (an asynchronous one's completion included: `Checkpointer.cost_s`)."""
        self.local, self.agree, self.clock = local, agree, clock
        self.end_now = end_now
        self.checkpoint_cost = checkpoint_cost
        self.phase = Phase.WATCHING
        self.notice: Notice | None = None
        self.window_s = 0.0
        """The longest of the last windows (decaying, so one slow window is forgotten)."""
        self.blocking_s: float | None = None
        """The last checkpoint's blocking part on this rank; None before the first."""
        self.validation_s = 0.0
        """The last validation's time on this rank."""
        self.cadence: Cadence | None = None
        """The group's boundaries, once its length is known (none: windows and checkpoints)."""
        self.ends_at: float | None = None
        """When the group ends, once rank 0 brought the deadline forward."""
        self.sizing_note: str | None = None
        """What `end_now` could not do besides ending the group (Ray's sizing not told)."""

    def signal(self, step: int = 0) -> bool:
        """Whether this rank raises the signal of the window that makes step `step + 1`."""
        if self.phase is Phase.WATCHING:
            return self.local() is not None
        if self.phase is Phase.NOTICED:
            return self.clock() + self.needed_s(step) >= self.notice.deadline
        return False

    @property
    def checkpoint_s(self) -> float | None:
        """A checkpoint's time on this rank, whole: its blocking part, and an asynchronous
        write's completion as last measured; None before the first."""
        known = [s for s in (self.blocking_s, self.checkpoint_cost()) if s is not None]
        return max(known) if known else None

    def needed_s(self, step: int = 0) -> float:
        """What this window, the next, their boundaries and the checkpoint after the next need
        before the deadline, with a margin for a slow one. Not signalled now, the last
        checkpoint comes after the next window at the earliest; on the way, the boundary after
        this window may validate and write a periodic checkpoint, and the next may validate
        (its periodic checkpoint would be the last one)."""
        ckpt = self.checkpoint_s or 0.0
        c = self.cadence
        extra = 0.0
        if c is not None:
            extra += self.validation_s * (c.should_validate(step + 1) + c.should_validate(step + 2))
            extra += ckpt * c.should_checkpoint(step + 1)
        work = 2 * self.window_s + ckpt + extra
        return work + max(1.0, 0.25 * (self.window_s + ckpt + extra))

    def after_window(self, signals: int, window_s: float) -> Decision:
        self.window_s = max(window_s, 0.9 * self.window_s)
        if not signals:
            return None
        if self.phase is Phase.WATCHING:
            info = self.agree()
            if info is None:
                return None  # rank 0 has not been told yet: the next window asks again
            self.notice = Notice.of(info, self.clock())
            self.phase = Phase.NOTICED
            return CheckpointNow(self.notice)
        if self.phase is Phase.NOTICED:
            self.phase = Phase.ENDING
            return LastCheckpoint(self.notice)
        return None

    def too_short(self) -> bool:
        """A checkpoint is known to take longer than the time the notice leaves."""
        return self.checkpoint_s is not None and self.checkpoint_s >= self.seconds_left()

    def give_up(self) -> None:
        """No checkpoint fits before the deadline: no more signals for this notice."""
        self.phase = Phase.OVER

    def seconds_left(self) -> float:
        return self.notice.deadline - self.clock() if self.notice else float("inf")

    def end_group(self) -> str | None:
        """Once the last checkpoint is written (rank 0): the group ends now rather than at the
        deadline. None when it does, else why not (the ranks then wait for the deadline)."""
        if self.end_now is None or self.notice is None:
            return "no way to end it here"
        try:
            self.sizing_note = self.end_now(self.notice.nodes)
        except Exception as exc:  # the wait for the deadline still ends the group
            return f"{type(exc).__name__}: {exc}"[:300]
        self.ends_at = self.clock() + END_AFTER_S
        return None

    def stand_by(self, sleep: Callable[[float], None] = time.sleep) -> None:
        """Waits for Ray Train to end the group at the deadline. Returns only when it did not
        (the drain was cancelled): training then goes on, and this notice is done with."""
        until = self.notice.deadline + STANDBY_GRACE_S
        while self.clock() < until:
            sleep(min(1.0, max(0.0, until - self.clock())))
        self.phase = Phase.OVER


class Reclaim:
    """Carries out a boundary's `Decision`, in one place: the checkpoints a notice asks for,
    the events that say what was done, the early end of the group and the wait for it.
    `checkpoint(reason)` writes this step's checkpoint and returns the seconds training waited;
    `wait()` returns once a checkpoint in flight is in storage, with the seconds it waited."""

    def __init__(
        self,
        watch: PreemptionWatch,
        *,
        rank: int,
        checkpoint: Callable[[str], float],
        wait: Callable[[], float],
        outbox: Any,
    ):
        self.watch, self.rank, self.outbox = watch, rank, outbox
        self.checkpoint, self.wait = checkpoint, wait

    def carry_out(
        self, decision: Decision, step: int, *, checkpointed: bool, is_last: bool, last_saved
    ) -> None:
        """`checkpointed`: this boundary wrote a checkpoint already; `last_saved()`: the step of
        the newest checkpoint this group restored or wrote."""
        if decision is None:
            return
        watch = self.watch
        # a checkpoint still in flight is in storage before anything a notice asks for
        waited = self.wait()
        if waited:
            self.outbox.send(CheckpointWaited(step, waited))
        if isinstance(decision, LastCheckpoint):
            if not checkpointed:
                self.checkpoint("before the reclaim")
            if is_last:
                return  # the run is done: nothing to wait for
            # rank 0 alone: one request to Ray for the whole group
            kept_until_deadline = watch.end_group() if self.rank == 0 else None
            self.outbox.send(
                ReclaimStandby(
                    step,
                    watch.seconds_left(),
                    kept_until_deadline,
                    deadline_at=watch.ends_at or watch.notice.deadline,
                    sizing_note=watch.sizing_note,
                )
            )
            self.outbox.flush()
            watch.stand_by()
            return
        # the ranks' clocks and checkpoint times differ: rank 0's judgement holds for all
        too_short = all_gather_objects(not checkpointed and watch.too_short())[0]
        seconds_left = watch.seconds_left()
        checkpoint_s = None
        if too_short:
            watch.give_up()
        elif not checkpointed:
            checkpoint_s = self.checkpoint("preemption notice")
        notice = decision.notice
        self.outbox.send(
            PreemptionNotice(
                step=step,
                nodes=notice.nodes,
                ranks=notice.ranks,
                seconds_left=seconds_left,
                deadline_given=notice.deadline_given,
                checkpoint_s=checkpoint_s,
                checkpoint_step=last_saved(),
                too_short=too_short,
                deadline_at=notice.deadline,
            )
        )
        self.outbox.flush()


def ray_notice_sources() -> tuple[Callable[[], Any], Callable[[], Any], Callable | None]:
    """(local, agree, end_now) for a Ray Train worker. The local read is of Ray Train's worker
    context, which its preemption watcher marks on every worker; a Ray without it gives no
    local notices (and so no notices at all: the periodic checkpoints remain)."""
    import ray.train

    try:
        from ray.train.v2._internal.execution.context import get_train_context

        context = get_train_context().preemption_context
    except (ImportError, AttributeError, RuntimeError):
        return (lambda: None), ray.train.get_preemption_info, None
    return (lambda: context.preemption_info), ray.train.get_preemption_info, end_group_now


def end_group_now(nodes: Sequence[str]) -> str | None:
    """Drains `nodes` for preemption again, with a deadline `END_AFTER_S` away: Ray Core keeps
    the newer request, Ray Train's watcher passes the earlier deadline on and its controller
    ends the group then (a preemption, not a failure) and places the next one without them —
    at once, Ray's elastic sizing having been told to count them out (`capacity.count_out`).
    The node is leaving anyway; whatever else runs there sees the earlier deadline too.
    Returns what could not be done besides (None: nothing)."""
    import ray

    gcs = ray._private.worker.global_worker.gcs_client
    deadline = time.time() + END_AFTER_S
    for node in nodes:
        capacity.drain(
            gcs, node, "rayacc: the last checkpoint before the reclaim is written", deadline
        )
    try:
        # never made here (a rank may be on a node that goes): the driver made it, if any
        capacity.count_out(nodes, create=False)
    except Exception as exc:  # the group still ends; its successor may be tried at the old size
        return (
            "Ray's elastic sizing counts the node until its own next look: "
            f"{type(exc).__name__}: {exc}"
        )[:300]
    return None
