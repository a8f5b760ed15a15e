"""After a group ends: where the wait went (goodput's checkpoint waits and recomputed
validations), how long until training again (`Recoveries`), and the cluster's live nodes
recounted for Ray's elastic sizing when they change (`NodeWatch`). The whole stack — a reclaim
on a multi-node cluster — is tests/cluster/test_spot.py."""

from __future__ import annotations

import pytest

from rayacc.cluster.capacity import NodeWatch
from rayacc.observe.events import (
    Checkpointed,
    CheckpointWaited,
    PreemptionNotice,
    ReclaimStandby,
    RunStarted,
)
from rayacc.observe.goodput import Goodput, Recoveries, describe


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def started(step: int, process_at: float | None = None) -> RunStarted:
    return RunStarted(step, 40, step or None, "", {}, 0.1, process_started_at=process_at)


def notice(step: int, seconds_left: float, deadline_at: float | None = None) -> PreemptionNotice:
    return PreemptionNotice(step, ("n",), (1,), seconds_left, True, 0.5, step, False, deadline_at)


def test_checkpoint_waits_and_recomputed_validations_are_named_not_other():
    """Known seconds on a clock that moves with them: a checkpoint whose 2.5 s began with 2 s
    of waiting for the one before, a 4 s validation after a step the next group does again, a
    3 s wait for the checkpoint in flight at a reclaim. Nothing is left for `other`."""
    clock = Clock(100.0)
    g = Goodput(started=100.0, clock=clock)
    g.on_event(started(0))
    for step in (1, 2, 3):
        clock.t += 1.0
        g.on_step({"step": step, "perf/step_time_s": 1.0})
    clock.t += 2.5
    g.on_event(Checkpointed(3, 2.5, "periodic", waited_s=2.0))
    clock.t += 1.0 + 4.0
    g.on_step({"step": 4, "perf/step_time_s": 1.0, "val/time_s": 4.0})
    clock.t += 3.0
    g.on_event(CheckpointWaited(4, 3.0))
    clock.t += 1.0
    g.on_event(started(2))  # the group before kept step 2 only: 3 and 4 are done again
    split = g.split(wall_s=clock.t - 100.0)
    assert split["checkpoint_s"] == pytest.approx(0.5)
    assert split["checkpoint_wait_s"] == pytest.approx(2.0 + 3.0)
    assert split["recomputed_s"] == pytest.approx(1.0 + 1.0 + 4.0)
    assert split["validation_s"] == 0.0  # the one validation was of a step done again
    assert split["restarts_s"] == pytest.approx(1.0)
    assert split["other_s"] == pytest.approx(0.0, abs=1e-9)
    assert "checkpoint waits 5.0 s" in describe(split)


def trained(steps: int) -> tuple[Clock, Recoveries]:
    """A first group's `steps` steps, a second each from t = 1000."""
    clock = Clock(1000.0)
    r = Recoveries(clock)
    r.on_event(started(0))
    for step in range(1, steps + 1):
        clock.t += 1.0
        r.on_step({"step": step})
    return clock, r


def test_a_reclaim_ended_early_is_measured_from_the_deadline_it_set():
    clock, r = trained(5)
    r.on_event(notice(5, 30.0, deadline_at=1035.0))  # arrives at 1005: the deadline 30 s on
    clock.t = 1012.0
    r.on_step({"step": 6})
    r.on_event(ReclaimStandby(6, 22.0, None, deadline_at=1013.0))  # ended: a second from now
    clock.t = 1013.5
    r.on_event(started(6, process_at=1015.0))
    clock.t = 1022.0
    recovery = r.on_step({"step": 7})
    assert recovery is not None
    assert recovery.notice_to_deadline_s == pytest.approx(8.0)
    assert recovery.back_s == pytest.approx(9.0)
    assert recovery.group_start_s == pytest.approx(7.0)
    assert recovery.recomputed == 0
    assert recovery.console_line() == (
        "reclaim: notice → deadline 8.0 s, deadline → training again 9.0 s (group start 7.0 s), "
        "steps recomputed 0"
    )
    assert r.on_step({"step": 8}) is None  # one line per recovery
    assert r.done == [recovery]


def test_a_loss_without_notice_counts_from_the_last_item_and_the_steps_done_again():
    clock, r = trained(7)
    clock.t = 1030.0
    # a worker process older than the end of the group before (a pooled one): the group's
    # start is counted from that end, never from before it
    r.on_event(started(4, process_at=990.0))
    clock.t = 1040.0
    recovery = r.on_step({"step": 5})
    assert recovery is not None and recovery.notice_to_deadline_s is None
    assert recovery.back_s == pytest.approx(33.0) and recovery.group_start_s == pytest.approx(33.0)
    assert recovery.recomputed == 3
    assert recovery.console_line().startswith("back to training at step 5: group end → training")


def test_the_first_group_is_no_recovery():
    clock = Clock()
    r = Recoveries(clock)
    r.on_event(started(0, process_at=clock.t))
    assert r.on_step({"step": 1}) is None and r.done == []


class Nodes:
    def __init__(self, *ids: str):
        self.ids = frozenset(ids)
        self.fail = False

    def __call__(self) -> frozenset[str]:
        if self.fail:
            raise ConnectionError("the GCS did not answer")
        return self.ids


def watch_of(nodes, clock, draining=dict, **options):
    told, left, warned = [], [], []
    watch = NodeWatch(
        warned.append,
        every_s=1.0,
        **options,
        nodes=nodes,
        draining=draining,
        tell=lambda: told.append(1),
        leave=left.append,
        clock=clock,
        wall=clock,
    )
    return watch, told, left, warned


def test_the_node_watch_recounts_when_the_live_nodes_change_and_only_then():
    clock, nodes = Clock(), Nodes("a", "b")
    watch, told, left, warned = watch_of(nodes, clock)
    watch.poll()
    clock.t += 1.0
    watch.poll()
    assert told == []  # the first look sets what is known; nothing changed since
    nodes.ids = frozenset({"a"})  # b is lost
    watch.poll()
    assert told == []  # polled within the second: not looked at yet
    clock.t += 1.0
    watch.poll()
    assert told == [1] and watch.recounts == 1
    clock.t += 1.0
    watch.poll()
    assert told == [1]
    nodes.ids = frozenset({"a", "c"})  # c joins
    clock.t += 1.0
    watch.poll()
    assert told == [1, 1] and left == []
    nodes.fail = True
    clock.t += 1.0
    watch.poll()
    clock.t += 1.0
    watch.poll()
    assert len(warned) == 1 and "ConnectionError" in warned[0] and watch.stopped


def test_a_drained_node_is_counted_out_just_before_its_deadline_and_not_sooner():
    """Not while the group there may still run unaware (Ray Train's watcher looks every 5 s:
    counted out then, the group could be resized under the ranks), but ahead of the deadline
    (Ray Train sizes the next group the moment it ends this one)."""
    clock, nodes = Clock(1000.0), Nodes("a", "b")
    drains = {"b": int(1010.0 * 1000), "elsewhere": int(990.0 * 1000)}
    watch, told, left, _ = watch_of(nodes, clock, draining=lambda: drains)
    for _ in range(6):  # the drain first seen at 1001; its deadline is 3 s away at 1007
        clock.t += 1.0
        watch.poll()
    assert left == [] and told == []  # "elsewhere" is no live node of the cluster
    clock.t += 1.0
    watch.poll()
    assert left == [["b"]] and clock.t == 1007.0
    clock.t += 1.0
    watch.poll()
    # said again at each look while it drains (a coordinator restarted meanwhile forgot it),
    # counted once
    assert left == [["b"], ["b"]] and watch.recounts == 1
    nodes.ids = frozenset({"a"})  # then the node goes: the coordinator recounts as well
    del drains["b"]
    clock.t += 1.0
    watch.poll()
    assert told == [1] and left == [["b"], ["b"]]


def test_a_drain_first_seen_close_to_its_deadline_waits_for_rays_watcher_or_the_deadline():
    clock, nodes = Clock(1000.0), Nodes("a", "b")
    drains = {"b": int(1004.0 * 1000)}
    watch, _, left, _ = watch_of(nodes, clock, draining=lambda: drains)
    for _ in range(3):  # seen at 1001, 3 s before its deadline: too soon to be known
        clock.t += 1.0
        watch.poll()
    assert left == []
    clock.t += 1.0  # 1004: the deadline
    watch.poll()
    assert left == [["b"]]


def test_a_standby_says_when_rays_sizing_was_not_told():
    standby = ReclaimStandby(9, 4.2, None, deadline_at=1.0, sizing_note="Ray's elastic sizing …")
    assert standby.console_line().endswith(
        "the group ends now and restarts without the reclaimed node (Ray's elastic sizing …)"
    )


def test_where_the_ranks_handle_the_notice_the_watch_counts_out_at_the_deadline_only():
    """Their last windows and checkpoint run until just before the deadline (rank 0 counts the
    node out itself once they are done); the watch is the fallback at the deadline."""
    clock, nodes = Clock(1000.0), Nodes("a", "b")
    drains = {"b": int(1010.0 * 1000)}
    watch, _, left, _ = watch_of(nodes, clock, draining=lambda: drains, lead_s=0.0)
    for _ in range(9):
        clock.t += 1.0
        watch.poll()
    assert left == []
    clock.t += 1.0
    watch.poll()
    assert left == [["b"]] and clock.t == 1010.0


def test_a_coordinator_being_restarted_is_told_at_the_next_look_and_the_watch_goes_on():
    """Ray restarts its coordinator in place; a call to it meanwhile fails with one of Ray's
    errors (or times out on a loaded head). The node is still due at the next look: the watch
    warns once and keeps looking, where any other failure stops it."""
    from ray.exceptions import GetTimeoutError

    clock, nodes = Clock(1000.0), Nodes("a", "b")
    drains = {"b": int(1002.0 * 1000)}
    left, warned, failing = [], [], [GetTimeoutError("the coordinator did not answer")] * 2

    def leave(names):
        if failing:
            raise failing.pop()
        left.append(names)

    watch = NodeWatch(
        warned.append, every_s=1.0, nodes=nodes, draining=lambda: drains, tell=lambda: None,
        leave=leave, clock=clock, wall=clock,
    )  # fmt: skip
    for _ in range(3):  # 1001 (3 s lead: due once known, or at the deadline at 1002), ...
        clock.t += 1.0
        watch.poll()
    assert left == [] and not watch.stopped and len(warned) == 1
    assert "GetTimeoutError" in warned[0] and "asked again" in warned[0]
    clock.t += 1.0
    watch.poll()
    assert left == [["b"]] and watch.recounts == 1 and len(warned) == 1


def test_a_re_planned_schedule_speaks_in_whole_steps_or_in_samples():
    """`the run's length changed from 19.5 to 29.125 steps`: a short window makes the
    schedule's length a fraction of a step, which is no count a user has; said in samples."""
    from rayacc.observe.events import ScheduleChanged

    whole = ScheduleChanged(4, 4.0, 8.0, 0.01, reference_batch=256)
    assert "from 4 steps to 8 steps" in whole.console_line()
    assert whole.describe() == "step 4: length 4 steps→8 steps, LR 0.01 decays from there"
    short = ScheduleChanged(19, 19.5, 29.125, 0.01, reference_batch=256)
    assert "from 4,992 samples to 7,456 samples" in short.console_line()
    assert ScheduleChanged(3, None, 8.0, 0.01).describe().startswith("step 3: length open-ended")
