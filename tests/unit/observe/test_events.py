"""Typed events, the driver's observers and the step clock: pure Python, no Ray."""

import time
from dataclasses import replace

import pytest

from rayacc.driver.fit import History
from rayacc.engine import StepClock
from rayacc.observe.events import MicroBatchChanged, Resized, RunStarted


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
        new_micro_batch_size=4,
    )
    assert (
        resize.describe()
        == "step 4: workers 2→1, accum 4→8, global 32→32 (micro 4, effective LR 0.05)"
    )
    uneven = replace(resize, new_workers=3, new_grad_accum_steps=3, new_shares=(11, 11, 10))
    assert uneven.describe() == (
        "step 4: workers 2→3, accum 4→3, global 32→32 (micro 4, shares 11+11+10, effective LR 0.05)"
    )
    assert uneven.console_line() == (
        "resize at step 4: workers 2 → 3, accumulation 4 → 3, global batch 32 → 32, shares "
        "11 + 11 + 10, effective LR 0.05"
    )
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


def split(workers: int) -> dict[str, int]:
    return {
        "global_batch_size": 32,
        "micro_batch_size": 4,
        "grad_accum_steps": 8 // workers,
        "num_workers": workers,
    }


@pytest.mark.parametrize(
    ("before", "now", "line"),
    [
        # the fit's first group: nothing to say on a fresh run
        (None, RunStarted(0, 32, None, "layout", split(2), 0.05), None),
        # an elastic group that started at 1 worker and grew before its first checkpoint
        (
            RunStarted(0, 32, None, "layout", split(1), 0.05),
            RunStarted(0, 32, None, "layout", split(2), 0.05),
            "restarted from the beginning (no checkpoint yet): workers 1 → 2",
        ),
        # a failure before the first checkpoint, at the same size
        (
            RunStarted(0, 32, None, "layout", split(2), 0.05),
            RunStarted(0, 32, None, "layout", split(2), 0.05),
            "restarted from the beginning (no checkpoint yet)",
        ),
        # a restart that restores a checkpoint says so, whatever came before
        (
            RunStarted(0, 32, None, "layout", split(2), 0.05),
            RunStarted(8, 32, 8, "layout", split(1), 0.05),
            "resumed from the checkpoint at step 8",
        ),
    ],
)
def test_a_group_that_follows_another_says_where_it_starts_from(before, now, line):
    assert now.describe(before) == line


@pytest.mark.parametrize(
    ("items", "kept"),
    [
        # a group restarted from the checkpoint at 1: step 2 of the lost attempt is dropped
        (["start0", "1", "2", "start1", "2'", "3"], ["1", "2'", "3"]),
        # a resume at 2: steps 1..2 come from the checkpoint's lineage
        (["start2", "3"], ["1 ckpt", "2 ckpt", "3"]),
        # a restart at 2 in a fit that saw steps 1 and 2 itself keeps its own
        (["start0", "1", "2", "3", "start2", "3'"], ["1", "2", "3'"]),
        # a fresh start reads nothing
        (["start0", "1"], ["1"]),
    ],
)
def test_history_is_the_lineage_of_the_checkpoint_a_group_starts_from(items, kept):
    def lineage(step):
        assert step > 0, "a fresh start has no lineage to read"
        return [{"step": s, "v": f"{s} ckpt"} for s in range(1, step + 1)]

    history = History(lineage)
    for item in items:
        if item.startswith("start"):
            step = int(item.removeprefix("start"))
            history.on_event(RunStarted(step, 3, step or None, "layout", {}, 0.1))
        else:
            history.on_step({"step": int(item.rstrip("'")), "v": item})
    assert [r["v"] for r in history.records()] == kept
    assert len(history.events) == sum(i.startswith("start") for i in items)
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
