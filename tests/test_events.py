"""Typed events, the driver's observers and the step clock: pure Python, no Ray."""

import time

from rayacc.engine import StepClock
from rayacc.events import MicroBatchChanged, Resized, RunObserver, RunStarted
from rayacc.runner.driver import History


def test_events_describe_themselves_for_tags_and_console():
    resize = Resized(
        step=4,
        policy="keep_global_batch",
        old_workers=2,
        new_workers=1,
        old_grad_accum_steps=4,
        new_grad_accum_steps=8,
        old_global_batch_size=32,
        new_global_batch_size=32,
        effective_lr=0.05,
    )
    assert resize.describe() == "step 4: workers 2→1, accum 4→8, global 32→32"
    assert resize.console_line() == (
        "resize at step 4: workers 2 → 1, accumulation 4 → 8, global batch 32 → 32, "
        "effective LR 0.05"
    )
    auto = MicroBatchChanged(
        step=0, micro_batch_size=8, grad_accum_steps=2, reason="auto search", trials=((16, False),)
    )
    assert auto.describe() == "step 0: micro 8 × accum 2 (auto search)"
    assert auto.console_line() == (
        "micro-batch 8 × accumulation 2 from step 1 (auto search; tried 16✗)"
    )
    fresh = RunStarted(0, 60, None, "layout", {}, 0.006)
    assert fresh.describe() is None
    assert RunStarted(20, 60, 20, "layout", {}, 0.006).describe() == (
        "resumed from the checkpoint at step 20"
    )


def test_history_keeps_the_first_record_of_a_replayed_step_and_every_event():
    history = History()
    observers: list[RunObserver] = [history]
    started = RunStarted(0, 3, None, "layout", {}, 0.1)
    items = [started, {"step": 1, "v": "a"}, {"step": 2, "v": "b"}, {"step": 2, "v": "replay"}]
    for item in items:
        for o in observers:
            (o.on_step if isinstance(item, dict) else o.on_event)(item)
    assert [r["v"] for r in history.records()] == ["a", "b"]
    assert history.events == [started]
    assert history.first_item_at is not None


def test_step_clock_leaves_paused_time_out_of_the_lap():
    clock = StepClock()
    with clock.paused():
        time.sleep(0.2)
    time.sleep(0.05)
    lap = clock.lap()
    assert 0.04 <= lap < 0.15
    clock.restart()
    assert clock.lap() < 0.05
    assert clock.total_s >= lap
