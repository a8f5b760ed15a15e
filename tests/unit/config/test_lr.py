import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rayacc.engine import SampleSchedule, build_scheduler, effective_lr, lr_multiplier


@pytest.mark.parametrize(
    ("rule", "expected"),
    [("linear", 0.4), ("sqrt", 0.1 * math.sqrt(4)), ("none", 0.1)],
)
def test_rules_scale_up(rule, expected):
    assert effective_lr(0.1, 1024, 256, rule) == pytest.approx(expected)


def test_rules_scale_down():
    assert effective_lr(0.1, 64, 256, "linear") == pytest.approx(0.025)
    assert effective_lr(0.1, 64, 256, "sqrt") == pytest.approx(0.05)


def test_without_base_batch_the_lr_is_kept():
    assert effective_lr(3e-4, 512, None, "linear") == 3e-4


def test_unknown_rule_names_the_field():
    with pytest.raises(ValueError, match="optim.lr_scaling='cube'"):
        effective_lr(0.1, 8, 8, "cube")


def test_warmup_is_linear_to_one():
    mults = [lr_multiplier(s, warmup_steps=4, total_steps=None) for s in range(6)]
    assert mults == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_cosine_reaches_min_ratio_at_last_step():
    kw = dict(warmup_steps=2, total_steps=12, schedule="cosine", min_lr_ratio=0.1)
    assert lr_multiplier(1, **kw) == pytest.approx(1.0)
    assert lr_multiplier(2, **kw) == pytest.approx(1.0)
    assert lr_multiplier(11, **kw) == pytest.approx(0.1)
    mid = lr_multiplier(2 + 9 / 2, **kw)
    assert mid == pytest.approx(0.1 + 0.9 * 0.5)
    series = [lr_multiplier(s, **kw) for s in range(2, 12)]
    assert all(a > b for a, b in itertools.pairwise(series))


def test_constant_schedule():
    assert [
        lr_multiplier(s, warmup_steps=0, total_steps=10, schedule="constant") for s in (0, 5, 9)
    ] == [1, 1, 1]


def test_unknown_schedule():
    with pytest.raises(ValueError, match="optim.schedule"):
        lr_multiplier(3, warmup_steps=0, total_steps=10, schedule="step")


def test_scheduler_drives_the_optimizer_per_step():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.2)
    sched = build_scheduler(opt, warmup_steps=2, total_steps=4, schedule="cosine", min_lr_ratio=0.0)
    lrs = []
    for _ in range(4):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.1, 0.2, 0.2, 0.0])


def test_sample_schedule_matches_steps_at_the_reference_batch_and_does_not_jump():
    from rayacc.engine import SampleSchedule

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    s = SampleSchedule(
        opt,
        peak_lr=0.4,
        reference_batch=64,
        warmup_steps=2,
        total_steps=6,
        schedule="cosine",
        min_lr_ratio=0.0,
    )
    by_steps = [
        0.4 * lr_multiplier(i, warmup_steps=2, total_steps=6, min_lr_ratio=0.0) for i in range(6)
    ]
    seen = []
    for _ in range(3):
        seen.append(opt.param_groups[0]["lr"])
        s.step(64)
    # the global batch halves (keep_micro_batch at fewer workers): two steps cover one old step
    s.set_peak(0.2, rewarm_steps=2)
    mid = opt.param_groups[0]["lr"]
    assert mid == pytest.approx(
        0.4 * lr_multiplier(3, warmup_steps=2, total_steps=6, min_lr_ratio=0.0)
    )
    s.step(32)
    halfway = opt.param_groups[0]["lr"]
    assert halfway == pytest.approx(
        0.3 * lr_multiplier(3.5, warmup_steps=2, total_steps=6, min_lr_ratio=0.0)
    )
    s.step(32)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2 * by_steps[4] / 0.4)
    assert seen == pytest.approx(by_steps[:3])
    restored = SampleSchedule(
        opt,
        peak_lr=1.0,
        reference_batch=64,
        warmup_steps=2,
        total_steps=6,
        schedule="cosine",
        min_lr_ratio=0.0,
    )
    restored.load_state_dict(s.state_dict())
    assert restored.lr() == pytest.approx(s.lr())


def _last_lr(rows: int, global_batch: int, epochs: int, *, resize_at: int | None = None):
    """The LR the worker's schedule gives the last step of a run (built as the worker builds
    it), stepping it by each window's real samples. With `resize_at`, an elastic run under
    keep_micro_batch halves its global batch from that step on (a new peak, re-warmed)."""
    from rayacc.config import TrainConfig
    from rayacc.optim import build_schedule
    from rayacc.run.quantities import RunLength, epoch_layout, schedule_length

    cfg = TrainConfig.from_dict(
        {
            "batch": {"global_batch_size": global_batch, "micro_batch_size": 4},
            "scaling": {"num_workers": 2},
            "optim": {"lr": 0.5, "warmup_steps": 2, "schedule": "cosine", "min_lr_ratio": 0.1},
            "train": {"epochs": epochs},
        }
    )
    layout = epoch_layout(RunLength.of(cfg), rows, cfg.batch_split())
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    schedule = build_schedule(
        cfg.optim,
        opt,
        peak_lr=0.5,
        reference_batch=global_batch,
        total_steps=schedule_length(RunLength.of(cfg), layout),
    )
    g, step, lr = global_batch, 0, None
    for _ in range(epochs):
        left = rows
        while left >= 2:  # a window needs a row per rank
            if step == resize_at:
                g = global_batch // 2
                schedule.set_peak(0.25, rewarm_steps=5)
            lr = opt.param_groups[0]["lr"]
            samples = min(g, left)
            schedule.step(samples)
            left -= samples
            step += 1
    return lr


@pytest.mark.parametrize(
    "rows, global_batch", [(300, 256), (256, 256), (203, 32)], ids=["short", "exact", "uneven"]
)
def test_the_last_step_runs_at_the_minimum_lr_with_or_without_short_windows(rows, global_batch):
    assert _last_lr(rows, global_batch, epochs=10) == pytest.approx(0.1 * 0.5, rel=1e-9)


def test_the_last_step_runs_at_the_minimum_lr_after_an_elastic_resize():
    # 203 rows, global 32 → 16 at step 20: the schedule counts samples, so it still ends at the
    # last step, at the new peak's minimum
    assert _last_lr(203, 32, epochs=4, resize_at=20) == pytest.approx(0.1 * 0.25, rel=1e-9)


def _schedule(total, schedule="cosine", warmup=10):
    from rayacc.engine.lr import SampleSchedule

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return SampleSchedule(
        opt,
        peak_lr=1e-3,
        reference_batch=32,
        warmup_steps=warmup,
        total_steps=total,
        schedule=schedule,
        min_lr_ratio=0.1,
    )


@pytest.mark.parametrize(
    ("schedule", "done", "old_total", "new_total", "replanned"),
    [
        ("cosine", 150, 150, 200, True),  # a finished run lengthened: stays at the minimum
        ("cosine", 100, 150, 200, True),  # lengthened mid-decay
        ("cosine", 100, 150, 120, True),  # shortened mid-decay
        ("cosine", 5, 150, 200, False),  # still warming up: the warmup goes on as planned
        ("constant", 100, 150, 200, False),  # no decay to re-plan
        ("cosine", 100, 150, 150, False),  # the same length
    ],
)
def test_a_resume_that_changes_the_length_goes_on_from_the_lr_it_had(
    schedule, done, old_total, new_total, replanned
):
    """The LR of the first step after the resume is the one the uninterrupted schedule gave
    it; no warmup again; the decay then ends at min_lr_ratio × peak on the new last step."""
    before = _schedule(old_total, schedule)
    for _ in range(done):
        before.step(32)
    resumed = _schedule(new_total, schedule)
    resumed.load_state_dict(before.state_dict())
    assert resumed.lr() == pytest.approx(before.lr(), rel=1e-12)
    assert (resumed.replanned is not None) == replanned
    if replanned:
        assert resumed.replanned[:2] == (old_total, new_total)
    lrs = [resumed.lr()]
    for _ in range(done, new_total - 1):
        resumed.step(32)
        lrs.append(resumed.lr())
    if schedule == "cosine":
        assert lrs[-1] == pytest.approx(1e-4, rel=1e-9), "ends at min_lr_ratio × peak"
    if done >= 10:
        assert all(b <= a + 1e-15 for a, b in itertools.pairwise(lrs)), "no warmup again"
    # saved and loaded again at the new length: nothing more changes
    again = _schedule(new_total, schedule)
    again.load_state_dict(resumed.state_dict())
    assert again.replanned is None and again.lr() == resumed.lr()


def test_a_short_window_inside_the_warmups_last_step_stays_at_the_peak():
    """A ZeRO-3 run printed lr 0.00353 against its peak 0.003: its position 5.6 of a warmup of
    6 gave (5.6 + 1) / 6."""
    assert lr_multiplier(5.6, warmup_steps=6, total_steps=40) == 1.0
    assert lr_multiplier(4.5, warmup_steps=6, total_steps=40) == pytest.approx(5.5 / 6)


@settings(max_examples=300, deadline=None)
@given(
    warmup=st.integers(0, 12),
    reference=st.integers(1, 16),
    windows=st.lists(st.integers(1, 24), min_size=1, max_size=40),
    schedule=st.sampled_from(["cosine", "constant"]),
    min_ratio=st.sampled_from([0.0, 0.1]),
    peak=st.floats(1e-5, 1.0),
)
def test_the_lr_never_passes_its_peak_and_is_the_schedules_value_at_every_step(
    warmup, reference, windows, schedule, min_ratio, peak
):
    """Any global batches per step (short windows, a resize), any warmup: at each optimizer
    step the LR is peak × the schedule at the step's sample position, never above the peak,
    and the multiplier moves no faster than its steepest part allows (continuous: no jump at
    the end of the warmup)."""
    total = sum(windows) / reference + 1
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    sched = SampleSchedule(
        optimizer, peak_lr=peak, reference_batch=reference, warmup_steps=warmup,
        total_steps=total, schedule=schedule, min_lr_ratio=min_ratio,
    )  # fmt: skip
    slope = max(1 / warmup if warmup else 0.0, math.pi / 2 / max(total - 1 - warmup, 1e-9))
    position, before = 0.0, None
    for samples in windows:
        lr = optimizer.param_groups[0]["lr"]
        expected = lr_multiplier(
            position, warmup_steps=warmup, total_steps=total, schedule=schedule,
            min_lr_ratio=min_ratio,
        )  # fmt: skip
        assert lr <= peak * (1 + 1e-12)
        assert lr == pytest.approx(peak * expected, rel=1e-12)
        if before is not None and position >= 0:
            moved = abs(expected - before[1])
            assert moved <= slope * (position - before[0]) + 1e-9
        before = (position, expected)
        sched.step(samples)
        position += samples / reference
