"""A reclaim with notice, one rank's side (worker/preemption.py), and the goodput split
(rayacc/observe/goodput.py), on a clock the test moves. The whole stack — a node drained for
preemption on a multi-node cluster — is tests/test_spot.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from rayacc.observe.events import Checkpointed, PreemptionNotice, ReclaimStandby, RunStarted
from rayacc.observe.goodput import PARTS, Goodput, describe, percent
from rayacc.worker.cadence import Cadence
from rayacc.worker.preemption import (
    DEFAULT_DEADLINE_S,
    STANDBY_GRACE_S,
    CheckpointNow,
    LastCheckpoint,
    Phase,
    PreemptionWatch,
    Reclaim,
)


def kind(decision) -> str | None:
    """A boundary's decision as the cases write it."""
    if decision is None:
        return None
    return {CheckpointNow: "notice", LastCheckpoint: "last"}[type(decision)]


@dataclass
class Info:
    """Ray Train's PreemptionInfo, as far as the watch reads it."""

    deadline_ms: int | None
    preempted_node_to_ranks: dict = field(default_factory=lambda: {"node-b": [1]})

    @property
    def preempted_node_ids(self):
        return sorted(self.preempted_node_to_ranks)

    @property
    def preempted_ranks(self):
        return sorted(r for ranks in self.preempted_node_to_ranks.values() for r in ranks)


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def run_windows(watch: PreemptionWatch, clock: Clock, n: int, window_s: float, others=0):
    """n windows of `window_s`; `others`: signals the other ranks raise each window. Returns
    (window index, action) for each action."""
    actions = []
    for i in range(n):
        signals = int(watch.signal()) + others
        clock.t += window_s
        action = kind(watch.after_window(signals, window_s))
        if action:
            actions.append((i, action))
            if action in ("notice", "last"):
                clock.t += 0.5  # the checkpoint
                watch.blocking_s = 0.5
    return actions


CASES = [
    # (what, local notice from window, rank 0 told from window, deadline in s after t0, window s,
    #  expected actions)
    ("no notice", None, None, 60, 1.0, []),
    ("notice, deadline 30 s", 2, 2, 30, 1.0, [(2, "notice"), (26, "last")]),
    # rank 0 is told a window after this rank: the barrier says None once, asked again
    ("rank 0 told later", 2, 3, 30, 1.0, [(3, "notice"), (26, "last")]),
    ("slow windows", 1, 1, 30, 4.0, [(1, "notice"), (5, "last")]),
    ("no deadline given: Ray's 120 s", 0, 0, None, 5.0, [(0, "notice"), (23, "last")]),
]


@pytest.mark.parametrize(
    "what, local_from, told_from, deadline_s, window_s, expected",
    CASES,
    ids=[c[0] for c in CASES],
)
def test_notice_then_a_last_checkpoint_as_late_as_the_deadline_allows(
    what, local_from, told_from, deadline_s, window_s, expected
):
    clock = Clock()
    t0 = clock.t
    window = {"i": 0}
    info = Info(None if deadline_s is None else int((t0 + deadline_s) * 1000))

    def local():
        return info if local_from is not None and window["i"] >= local_from else None

    def agree():
        return info if told_from is not None and window["i"] >= told_from else None

    watch = PreemptionWatch(local, agree, clock)
    actions = []
    for i in range(40):
        window["i"] = i
        signals = int(watch.signal())
        clock.t += window_s
        action = kind(watch.after_window(signals, window_s))
        if action:
            actions.append((i, action))
            clock.t += 0.5  # the checkpoint
            watch.blocking_s = 0.5
        if action == "last":
            left = watch.seconds_left()
            # what is left covers a window and a checkpoint, and not much more
            assert left > 0.5, left
            assert left < 3 * window_s + 0.5 + max(1.0, 0.25 * (window_s + 0.5)), left
            break
    assert actions == expected, (what, actions)
    if expected:
        deadline = t0 + (deadline_s if deadline_s is not None else DEFAULT_DEADLINE_S)
        assert watch.notice.deadline == pytest.approx(deadline, abs=window_s + 1)
        assert watch.notice.nodes == ("node-b",) and watch.notice.ranks == (1,)


def worker_order(
    deadline_s, window_s, val_every, val_s, ckpt_every, ckpt_s, notice_at, *, budget=True
):
    """The worker's order on a moved clock (worker/loop.py): the window's signal, the window,
    its boundary as the `Cadence` says (validation, then a periodic checkpoint), then the
    watch's action (a notice: a checkpoint now unless one was just written; the last: the
    last checkpoint). Returns (when the last checkpoint ended, relative to the deadline; the
    step it holds). `budget=False`: the watch does not know the boundaries (the old budget)."""
    clock = Clock()
    info = Info(int((clock.t + deadline_s) * 1000))
    at = {"window": 0}

    def told():
        return info if at["window"] >= notice_at else None

    watch = PreemptionWatch(told, told, clock)
    boundaries = Cadence(10_000, val_every, ckpt_every, validates=True)
    watch.cadence = boundaries if budget else None
    for n in range(10_000):
        at["window"] = n
        signals = int(watch.signal(n))
        clock.t += window_s
        step = n + 1
        if boundaries.should_validate(step):
            clock.t += val_s
            watch.validation_s = val_s
        checkpointed = boundaries.should_checkpoint(step)
        if checkpointed:
            clock.t += ckpt_s
            watch.blocking_s = ckpt_s
        action = kind(watch.after_window(signals, window_s))
        if action in ("notice", "last") and not checkpointed:
            clock.t += ckpt_s
            watch.blocking_s = ckpt_s
        if action == "last":
            return clock.t - watch.notice.deadline, step
    raise AssertionError("no last checkpoint")


BOUNDARY_CASES = [
    # (what, deadline s, window s, validation every / s, checkpoint every / s, notice at window)
    ("windows only", 120, 5.0, None, 0.0, None, 3.0, 2),
    ("a long validation every 4 steps", 120, 5.0, 4, 20.0, None, 3.0, 5),
    ("a periodic checkpoint every 3 steps", 120, 5.0, None, 0.0, 3, 8.0, 2),
    ("both, every step", 120, 2.0, 1, 3.0, 1, 3.0, 2),
    ("validation and checkpoint every 5, 30 s notice", 30, 1.0, 5, 6.0, 5, 2.0, 6),
    ("the reported case: validation 25 s every 10", 120, 4.0, 10, 25.0, 20, 5.0, 11),
]


@pytest.mark.parametrize(
    "what, deadline_s, window_s, val_every, val_s, ckpt_every, ckpt_s, notice_at",
    BOUNDARY_CASES,
    ids=[c[0] for c in BOUNDARY_CASES],
)
def test_the_last_checkpoint_ends_before_the_deadline_whatever_the_boundaries_run(
    what, deadline_s, window_s, val_every, val_s, ckpt_every, ckpt_s, notice_at
):
    """The budget counts the validations and periodic checkpoints on the way: the last
    checkpoint ends before the deadline, and not more than a window and its boundaries early."""
    late, step = worker_order(deadline_s, window_s, val_every, val_s, ckpt_every, ckpt_s, notice_at)
    assert late < 0, f"{what}: the last checkpoint (step {step}) ended {late:.1f} s after"
    most_boundary = (val_s if val_every else 0) * 2 + (ckpt_s if ckpt_every else 0) + ckpt_s
    slack = 2 * window_s + most_boundary + max(1.0, 0.25 * (window_s + most_boundary))
    assert -late <= slack + window_s, f"{what}: {-late:.1f} s to spare, over {slack:.1f}"


def test_a_budget_blind_to_the_boundaries_misses_the_deadline():
    """What the table guards: without the boundaries, a long validation on the way makes the
    last checkpoint end after the deadline."""
    late, _ = worker_order(120, 4.0, 10, 25.0, 20, 5.0, 11, budget=False)
    assert late > 0, late


def test_another_ranks_signal_makes_every_rank_ask_and_decide_in_the_same_window():
    """This rank holds no notice yet, or thinks the deadline is far: another rank's signal
    still makes it call the barrier, and take the last checkpoint, in that window."""
    clock = Clock()
    info = Info(int((clock.t + 100) * 1000))
    watch = PreemptionWatch(lambda: None, lambda: info, clock)
    assert watch.phase is Phase.WATCHING
    assert kind(watch.after_window(1, 1.0)) == "notice"
    assert watch.phase is Phase.NOTICED
    assert not watch.signal()  # 100 s left: not yet
    assert kind(watch.after_window(1, 1.0)) == "last"  # another rank judged it time
    assert watch.phase is Phase.ENDING
    assert kind(watch.after_window(2, 1.0)) is None


def test_a_notice_shorter_than_a_checkpoint_is_too_short():
    clock = Clock()
    info = Info(int((clock.t + 3) * 1000))
    watch = PreemptionWatch(lambda: info, lambda: info, clock)
    watch.blocking_s = 8.0
    assert kind(watch.after_window(1, 0.1)) == "notice"
    assert watch.too_short()
    watch.give_up()
    assert watch.phase is Phase.OVER
    assert not watch.signal() and kind(watch.after_window(2, 0.1)) is None
    # a checkpoint never timed in this group: tried
    fresh = PreemptionWatch(lambda: info, lambda: info, clock)
    kind(fresh.after_window(1, 0.1))
    assert not fresh.too_short()


def test_stand_by_returns_only_when_no_restart_came():
    clock = Clock()
    info = Info(int((clock.t + 10) * 1000))
    watch = PreemptionWatch(lambda: info, lambda: info, clock)
    kind(watch.after_window(1, 1.0))
    watch.stand_by(sleep=clock.sleep)
    assert clock.t >= watch.notice.deadline + STANDBY_GRACE_S
    # the notice is done with: the same notice, still in the context, raises nothing
    assert not watch.signal() and kind(watch.after_window(1, 1.0)) is None


class Outbox:
    def __init__(self):
        self.sent, self.flushes = [], 0

    def send(self, event):
        self.sent.append(event)

    def flush(self):
        self.flushes += 1


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_notice_is_answered_with_a_checkpoint_unless_the_boundary_wrote_one(checkpointed):
    """`Reclaim` carries out a `CheckpointNow`: the checkpoint in flight waited for, a
    checkpoint now unless this boundary wrote one, the notice's event, handed over at once."""
    clock = Clock()
    info = Info(int((clock.t + 60) * 1000))
    watch = PreemptionWatch(lambda: info, lambda: info, clock)
    calls, outbox = [], Outbox()
    reclaim = Reclaim(
        watch,
        rank=0,
        checkpoint=lambda reason: calls.append(reason) or 0.25,
        wait=lambda: calls.append("wait"),
        outbox=outbox,
    )
    decision = watch.after_window(1, 1.0)
    reclaim.carry_out(decision, 7, checkpointed=checkpointed, is_last=False, last_saved=lambda: 7)
    assert calls == ["wait"] + ([] if checkpointed else ["preemption notice"])
    (event,) = outbox.sent
    assert isinstance(event, PreemptionNotice) and outbox.flushes == 1
    assert (event.step, event.checkpoint_step, event.too_short) == (7, 7, False)
    assert event.checkpoint_s == (None if checkpointed else 0.25)
    assert watch.phase is Phase.NOTICED


def test_the_last_checkpoint_ends_the_group_and_stands_by_unless_the_run_ends_there():
    clock = Clock()
    info = Info(int((clock.t + 5) * 1000))
    asked = []
    watch = PreemptionWatch(lambda: info, lambda: info, clock, end_now=asked.append)
    watch.stand_by = lambda: setattr(watch, "phase", Phase.OVER)  # no real wait
    calls, outbox = [], Outbox()
    reclaim = Reclaim(watch, rank=0, checkpoint=calls.append, wait=lambda: None, outbox=outbox)
    watch.after_window(1, 1.0)
    last = watch.after_window(1, 1.0)
    assert isinstance(last, LastCheckpoint)
    reclaim.carry_out(last, 9, checkpointed=False, is_last=True, last_saved=lambda: 9)
    assert calls == ["before the reclaim"] and outbox.sent == [] and asked == []
    reclaim.carry_out(last, 9, checkpointed=True, is_last=False, last_saved=lambda: 9)
    assert calls == ["before the reclaim"] and asked == [("node-b",)]
    (standby,) = outbox.sent
    assert isinstance(standby, ReclaimStandby) and standby.kept_until_deadline is None
    assert watch.phase is Phase.OVER
    reclaim.carry_out(None, 10, checkpointed=False, is_last=False, last_saved=lambda: 9)
    assert calls == ["before the reclaim"]


def refused(nodes):
    raise RuntimeError("Ray refused the drain of node n")


@pytest.mark.parametrize(
    ("end_now", "noticed", "why"),
    [
        ("records", True, None),
        (refused, True, "RuntimeError: Ray refused the drain of node n"),
        (None, True, "no way to end it here"),
        ("records", False, "no way to end it here"),  # no notice agreed: nothing to end
    ],
)
def test_the_group_ends_once_the_last_checkpoint_is_written(end_now, noticed, why):
    clock = Clock()
    info = Info(int((clock.t + 10) * 1000))
    asked = []
    if end_now == "records":
        end_now = asked.append
    watch = PreemptionWatch(lambda: info, lambda: info, clock, end_now=end_now)
    if noticed:
        kind(watch.after_window(1, 1.0))
    assert watch.end_group() == why
    assert asked == ([watch.notice.nodes] if why is None else [])


def test_quiet_sources_never_signal():
    watch = PreemptionWatch(lambda: None, lambda: None)
    assert run_windows(watch, Clock(), 10, 1.0) == []


NOTICES = [
    (
        PreemptionNotice(5, ("0123456789abcdef",), (1,), 28.4, True, 0.6, 5),
        "step 5: node 0123456789ab (ranks 1), deadline in 28.4 s, checkpoint 0.6 s, 27.8 s "
        "to spare",
        "reclaimed in 28 s; checkpoint of step 5 written in 0.6 s",
    ),
    (
        PreemptionNotice(6, ("n",), (0, 1), 120.0, False, None, 6),
        "step 6: node n (ranks 0,1), deadline in 120.0 s (none given), checkpoint of step 6 "
        "already written",
        "the drain gave no deadline",
    ),
    (
        PreemptionNotice(7, ("n",), (1,), 2.0, True, None, 4, too_short=True),
        "step 7: node n (ranks 1), deadline in 2.0 s, too short for a checkpoint: resumes from "
        "step 4",
        "too short for a checkpoint (one takes longer than that): none written, the restart "
        "resumes from the checkpoint of step 4",
    ),
    (
        PreemptionNotice(3, ("n",), (1,), 1.0, True, None, None, too_short=True),
        "resumes from step None",
        "resumes from the start of the run (no checkpoint yet)",
    ),
    (
        ReclaimStandby(9, 4.2),
        "step 9: last checkpoint, 4.2 s before the deadline",
        "the group ends now and restarts without the reclaimed node",
    ),
    (
        ReclaimStandby(9, 4.2, "RuntimeError: Ray refused the drain"),
        "step 9: last checkpoint, 4.2 s before the deadline",
        "the workers wait for the restart without the reclaimed node at the deadline (the "
        "group could not end at once: RuntimeError: Ray refused the drain)",
    ),
]


@pytest.mark.parametrize("event, tag, line", NOTICES)
def test_what_the_tag_and_the_console_say(event, tag, line):
    assert tag in event.describe()
    assert line in event.console_line()


def started(step: int) -> RunStarted:
    return RunStarted(step, 10, step or None, "", {}, 0.1)


def test_goodput_splits_the_wall_time():
    clock = Clock(100.0)
    g = Goodput(started=100.0, clock=clock)
    clock.t = 110.0
    g.on_event(started(0))  # start-up 10 s
    for step in (1, 2, 3, 4):
        clock.t += 1.0
        g.on_step({"step": step, "perf/step_time_s": 0.9})
    g.on_event(Checkpointed(2, 0.3, "periodic"))
    clock.t = 130.0  # the group failed in step 5; the next starts from step 2
    g.on_event(started(2))
    for step in (3, 4, 5):
        clock.t += 1.0
        g.on_step({"step": step, "perf/step_time_s": 1.0})
    g.on_event(Checkpointed(5, 0.2, "last"))
    split = g.split(wall_s=40.0)
    assert split["startup_s"] == pytest.approx(10.0)
    assert split["restarts_s"] == pytest.approx(130.0 - 114.0)
    assert split["steps_recomputed"] == 2 and split["recomputed_s"] == pytest.approx(1.8)
    assert split["training_s"] == pytest.approx(0.9 * 2 + 1.0 * 3)
    assert split["checkpoint_s"] == pytest.approx(0.5)
    parts = sum(split[k] for k in split if k.endswith("_s") and k != "wall_s")
    assert parts == pytest.approx(40.0)
    assert split["fraction"] == pytest.approx(4.8 / 40.0)
    assert split["restarts"] == 1
    line = describe(split)
    assert line.startswith("goodput 12%: training 4.8 s of 40.0 s (start-up 10.0 s, ")
    assert "restarts and resizes 16.0 s" in line and line.endswith("2 steps recomputed")


def test_goodput_finds_each_known_delay_in_its_category():
    """Known seconds in each category (the driver's checks, Ray and the group, the restore,
    the rank's set-up, data waits, validation, a checkpoint's blocking part, a restart, the
    steps done again): each is found in its category, and the categories sum to the wall."""
    clock = Clock(100.0)
    g = Goodput(started=100.0, clock=clock, checked=102.0)  # checks: 2 s
    clock.t = 116.0
    # Ray and the group: 8 s (102 → 110); restore 1.5 s; the rank's set-up 4.5 s
    g.on_event(RunStarted(0, 10, None, "", {}, 0.1, restore_s=1.5, entered_at=110.0))
    for step in (1, 2, 3, 4):
        clock.t += 1.0
        record = {"step": step, "perf/step_time_s": 0.8, "perf/data_wait_frac": 0.25}
        if step == 2:
            record["val/time_s"] = 2.0
            clock.t += 2.0
        g.on_step(record)
    g.on_event(Checkpointed(2, 0.7, "periodic"))
    clock.t += 10.0  # a failure in step 5: the next group restores step 2 in 1.2 s
    g.on_event(RunStarted(2, 10, 2, "", {}, 0.1, restore_s=1.2, entered_at=None))
    for step in (3, 4, 5):
        clock.t += 1.0
        g.on_step({"step": step, "perf/step_time_s": 0.8, "perf/data_wait_frac": 0.25})
    wall = clock.t - 100.0 + 1.0  # the end: 1 s of other
    split = g.split(wall_s=wall)
    injected = {
        "startup_s": 2.0 + 4.5,
        "group_start_s": 8.0,
        "restore_s": 1.5 + 1.2,
        "data_s": 0.2 * 5,
        "validation_s": 2.0,
        "checkpoint_s": 0.7,
        "recomputed_s": 0.8 * 2,
        "restarts_s": 10.0 - 1.2,
        "training_s": 0.6 * 5,
    }
    for key, seconds in injected.items():
        assert split[key] == pytest.approx(seconds, rel=0.02), key
    assert sum(split[k] for k in PARTS) == pytest.approx(wall)
    line = describe(split)
    for name in ("Ray and worker-group start 8.0", "checkpoint restore 2.7", "validation 2.0"):
        assert f"{name} s" in line, line


def test_a_start_read_after_the_first_steps_does_not_count_them_twice():
    """The driver reads rank 0's items every half second: a group's start can arrive in one
    batch with its first steps. Start-up (and a restart) end where rank 0 sent the start, so
    the parts never sum past the wall time."""
    clock = Clock(100.0)
    g = Goodput(started=100.0, clock=clock, checked=101.0)
    clock.t = 110.4  # sent at 110.0, read with steps 1 and 2 (0.2 s each)
    g.on_event(RunStarted(0, 10, None, "", {}, 0.1, entered_at=105.0, announced_at=110.0))
    for step in (1, 2):
        g.on_step({"step": step, "perf/step_time_s": 0.2})
    clock.t = 123.5  # a failure; the next group sends its start at 123.0, read with step 3
    g.on_event(RunStarted(2, 10, 2, "", {}, 0.1, restore_s=1.0, announced_at=123.0))
    g.on_step({"step": 3, "perf/step_time_s": 0.5})
    split = g.split(wall_s=23.6)
    assert split["startup_s"] == pytest.approx(1.0 + 5.0)  # checks + the rank's set-up
    assert split["group_start_s"] == pytest.approx(4.0)
    assert split["restarts_s"] == pytest.approx(123.0 - 110.4 - 1.0)
    assert split["other_s"] == pytest.approx(0.1)
    assert sum(split[k] for k in PARTS) == pytest.approx(23.6)


@pytest.mark.parametrize(
    "fraction, shown",
    [
        (0.0, "0%"),
        (0.0004, "<0.1%"),  # a short job: start-up is nearly all of it, yet training ran
        (0.003, "0.3%"),
        (0.049, "4.9%"),
        (0.12, "12%"),
        (0.994, "99%"),
        (0.996, "99.6%"),
        (0.9996, ">99.9%"),
        (1.0, "100%"),
    ],
)
def test_goodput_never_rounds_to_none_or_all(fraction, shown):
    assert percent(fraction) == shown
    split = {"fraction": fraction, "training_s": 1.0, "wall_s": 2.0}
    assert describe(split).startswith(f"goodput {shown}: ")


SPOT_CONFIGS = [
    # (scaling, train, expected warnings)
    ({"num_workers": 2}, {}, []),  # not on spot nodes
    ({"num_workers": [1, 2], "extra_resources": {"spot": 1}}, {}, []),
    ({"num_workers": 2, "extra_resources": {"spot": 1}}, {}, ["scaling.num_workers=2"]),
    (
        {"num_workers": [1, 2], "extra_resources": {"spot": 1}},
        {"checkpoint_on_preemption": False, "checkpoint_every_steps": 50},
        ["(up to 49)"],
    ),
    (
        {"num_workers": 2, "extra_resources": {"spot": 1}},
        {"checkpoint_on_preemption": False},
        ["scaling.num_workers=2", "none is written before the end"],
    ),
]


@pytest.mark.parametrize("scaling, train, expected", SPOT_CONFIGS)
def test_a_run_on_spot_nodes_is_warned_of_what_a_reclaim_would_cost(scaling, train, expected):
    from rayacc import TrainConfig
    from rayacc.driver.prelaunch import spot_warnings

    cfg = TrainConfig.from_dict(
        {
            "batch": {"global_batch_size": 64, "micro_batch_size": 4},
            "scaling": scaling,
            "train": train,
        }
    )
    warnings = spot_warnings(cfg.scaling, cfg.train)
    assert len(warnings) == len(expected), warnings
    for warning, words in zip(warnings, expected, strict=True):
        assert words in warning and "Fix:" in warning, warning


def test_the_budget_counts_an_asynchronous_checkpoint_whole():
    """After the group's first periodic async checkpoint only its blocking part was known: a
    notice then budgeted too little. The budget reads the whole write as last measured, and
    while one is in flight at least the time since it began."""
    import time as time_module
    from types import SimpleNamespace

    from rayacc.worker.checkpoint import Checkpointer, _InFlight

    clock = Clock()
    info = Info(int((clock.t + 100) * 1000))
    whole: list[float | None] = [None]
    watch = PreemptionWatch(lambda: info, lambda: info, clock, checkpoint_cost=lambda: whole[0])
    watch.blocking_s = 0.5
    blocking_only = watch.needed_s()
    whole[0] = 6.0  # the background write ended: 6 s in all
    assert watch.checkpoint_s == 6.0 and watch.needed_s() > blocking_only + 5

    flight = _InFlight(3, started=time_module.perf_counter() - 4.0)
    writing = SimpleNamespace(_in_flight=flight, complete_s=1.0)
    assert Checkpointer.cost_s(writing) >= 4.0  # still writing: at least its 4 s so far
    flight.done.set()
    assert Checkpointer.cost_s(writing) == 1.0


def test_a_notice_says_the_wait_for_the_checkpoint_in_flight_and_when_the_group_ends():
    """The wait for an asynchronous checkpoint before a notice's checkpoint is reported (it
    was nobody's time: goodput's "other"); the standby carries the deadline as rank 0 set it."""
    from rayacc.observe.events import CheckpointWaited
    from rayacc.worker.preemption import END_AFTER_S

    clock = Clock()
    info = Info(int((clock.t + 30) * 1000))
    watch = PreemptionWatch(lambda: info, lambda: info, clock, end_now=lambda nodes: None)
    watch.stand_by = lambda: setattr(watch, "phase", Phase.OVER)
    waits, outbox = [2.5, 0.0], Outbox()
    reclaim = Reclaim(
        watch, rank=0, checkpoint=lambda r: 0.1, wait=lambda: waits.pop(0), outbox=outbox
    )
    reclaim.carry_out(
        watch.after_window(1, 1.0), 3, checkpointed=False, is_last=False, last_saved=lambda: 3
    )
    waited, noticed = outbox.sent
    assert waited == CheckpointWaited(3, 2.5)
    assert noticed.deadline_at == pytest.approx(clock.t + 30, abs=1e-3)
    clock.t += 20.0
    reclaim.carry_out(
        watch.after_window(1, 1.0), 9, checkpointed=False, is_last=False, last_saved=lambda: 9
    )
    (standby,) = outbox.sent[2:]  # nothing was in flight: no wait reported
    assert standby.kept_until_deadline is None and standby.sizing_note is None
    assert standby.deadline_at == pytest.approx(clock.t + END_AFTER_S)
