"""`batch.schedule`: what the config refuses (generated from the rule's own table), the phases
a run derives (split and LR by the declared rule at each worker count), and the run's length
under phases (`windows_left`) against the walk the worker makes window by window
(`remaining_epochs` up to each phase's sample, then the next phase's split)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayacc import TrainConfig
from rayacc.config.batch_split import resolve_batch_split
from rayacc.config.errors import ConfigError
from rayacc.data.bundled import prepare_bundled
from rayacc.driver.prelaunch import prepare
from rayacc.engine.train_state import TrainState
from rayacc.run.quantities import RunLength, remaining_epochs, windows_left

BASE = {
    "batch": {
        "global_batch_size": 32,
        "micro_batch_size": 4,
        "schedule": [{"from_samples": 64, "global_batch_size": 64}],
    },
    "scaling": {"num_workers": 2},
}
REFUSED = {
    "batch.grad_accum_steps": {"batch": {"grad_accum_steps": 4}},
    "batch.micro_batch_size": {"batch": {"micro_batch_size": "auto", "memory_budget_mb": 64}},
    "train.strategy": {"train": {"strategy": "deepspeed"}},
    "scaling.on_resize": {"scaling": {"num_workers": [1, 2], "on_resize": "keep_micro_batch"}},
    "batch.schedule": {"batch": {"schedule": [{"from_samples": 64, "global_batch_size": 64},
                                              {"from_samples": 64, "global_batch_size": 128}]}},
    "batch.global_batch_size": {"batch": {"global_batch_size": None}},
    "batch.schedule[0].global_batch_size": {
        "batch": {"schedule": [{"from_samples": 64, "global_batch_size": 66}]}
    },
}  # fmt: skip
"""Each field the schedule's rules name, and a config that makes them name it."""


def _with(extra: dict) -> dict:
    out = {k: dict(v) for k, v in BASE.items()}
    for section, values in extra.items():
        out.setdefault(section, {}).update(values)
    return out


def test_every_exclusion_of_the_rules_has_its_case():
    from rayacc.config.batch_schedule import EXCLUDES

    assert set(EXCLUDES) <= set(REFUSED)
    TrainConfig.from_dict(BASE)  # the base is fine


@pytest.mark.parametrize("path", REFUSED)
def test_what_a_schedule_cannot_go_with_is_named(path):
    with pytest.raises(ConfigError) as refused:
        TrainConfig.from_dict(_with(REFUSED[path]))
    assert path in str(refused.value) and "Fix:" in str(refused.value), str(refused.value)


def test_each_phase_has_its_split_and_its_lr_by_the_declared_rule(tmp_path):
    cfg = TrainConfig.from_dict(
        _with(
            {
                "data": {"source": str(prepare_bundled("digits")), "val_fraction": 0.0},
                "optim": {"lr": 0.1, "base_batch_size": 32, "lr_scaling": "sqrt"},
                "scaling": {"num_workers": [1, 3]},
                "train": {"max_steps": 10},
                "run": {"storage_path": str(tmp_path / "runs")},
            }
        )
    )
    spec = prepare(cfg).spec
    assert [spec.phase_at(s) for s in (0, 63, 64, 10**6)] == [0, 0, 1, 1]
    assert spec.lr_at(2, 1) == pytest.approx(0.1 * 2**0.5) and spec.lr_at(2, 0) == 0.1
    # every size keeps each phase's global batch: uneven shares at 3
    assert spec.split_at(3, 1).rank_shares == (22, 21, 21)
    assert spec.split_at(1, 1).grad_accum_steps == 16
    # two steps of 32, then steps of 64: 10 steps are 64 + 8 × 64 samples
    assert spec.total_steps == 10
    assert spec.schedule_length == (64 + 7 * 64) / 32 + 1
    first = spec.epochs_from(TrainState(), spec.split_at(2), 0)
    assert [e.steps for e in first] == [2]  # up to the window that reaches sample 64
    # what `rayacc plan` and a run's header say of it
    from rayacc.run.quantities import phases_summary

    assert phases_summary(cfg) == [
        "batch schedule: from sample 64, global batch 64 = 22 + 21 + 21 rows over workers 3 "
        "(micro ≤ 4 × accum 6, the same on every rank), effective LR 0.141421"
    ]


def test_a_token_jobs_schedule_may_count_tokens(tmp_path):
    """`from_tokens`: a sample counts its input tokens (data.seq_len here); the phase starts at
    the first sample at or past the count, said in tokens and samples; a schedule counts in
    one unit, each phase by one field; two phases in one sample are refused by name."""
    from rayacc.data.common import DataError
    from rayacc.run.quantities import phases_summary, tokens_per_sample

    job = {
        "data": {"source": "shakespeare", "seq_len": 16, "val_fraction": 0.0},
        "model": {"name": "gpt", "n_layer": 1, "n_embd": 16, "n_head": 2, "block_size": 16},
        "batch": {
            "global_batch_size": 8,
            "micro_batch_size": 4,
            "schedule": [{"from_tokens": 1000, "global_batch_size": 16}],
        },
        "scaling": {"num_workers": 2},
        "train": {"max_steps": 10},
        "run": {"storage_path": str(tmp_path / "runs")},
    }
    cfg = TrainConfig.from_dict(job)
    spec = prepare(cfg).spec
    assert tokens_per_sample(spec.info) == 16
    assert [spec.phase_at(s) for s in (62, 63)] == [0, 1]  # ⌈1000 / 16⌉ = 63
    # 8 steps of 8 reach sample 64, past 63: then steps of 16
    assert [e.steps for e in spec.epochs_from(TrainState(), spec.split_at(2), 0)] == [8]
    assert spec.total_steps == 10 and spec.split_at(2, 1).global_batch_size == 16
    from rayacc.run.quantities import batch_phases

    with_data = phases_summary(cfg, batch_phases(cfg, 16))
    assert with_data[0].startswith("batch schedule: from token 1000 (sample 63), ")
    assert phases_summary(cfg)[0].startswith("batch schedule: from token 1000, global batch 16")
    for phases, says in (
        ([{"from_tokens": 100, "global_batch_size": 16}, {"from_samples": 99,
          "global_batch_size": 32}], "mix from_samples and from_tokens"),
        ([{"from_tokens": 100, "from_samples": 7, "global_batch_size": 16}], "give one of"),
        ([{"global_batch_size": 16}], "give one of"),
        ([{"from_tokens": 900, "global_batch_size": 16}, {"from_tokens": 100,
          "global_batch_size": 32}], "from_tokens do not increase"),
    ):  # fmt: skip
        with pytest.raises(ConfigError) as refused:
            TrainConfig.from_dict({**job, "batch": {**job["batch"], "schedule": phases}})
        assert "batch.schedule" in str(refused.value) and says in str(refused.value)
    same = [{"from_tokens": 1000, "global_batch_size": 16}, {"from_tokens": 1001,
            "global_batch_size": 32}]  # fmt: skip
    with pytest.raises(DataError) as refused:
        prepare(TrainConfig.from_dict({**job, "batch": {**job["batch"], "schedule": same}}))
    assert "fall in one sample of 16 tokens" in str(refused.value)


def _walk(length: RunLength, rows: int, phases: list[tuple[int, int]], ranks: int):
    """The worker's walk: windows laid out up to the next phase, run, laid out again."""
    state, last = TrainState(), None
    while True:
        phase = max(i for i, (start, _) in enumerate(phases) if start <= state.samples_seen)
        split = resolve_batch_split(
            num_workers=ranks, global_batch_size=phases[phase][1],
            uneven=True,
        )  # fmt: skip
        until = phases[phase + 1][0] if phase + 1 < len(phases) else None
        epochs = remaining_epochs(length, rows, state, split, 0, until_samples=until)
        if not epochs:
            return state.optimizer_step, last
        for ep in epochs:
            if ep.epoch != state.epoch:
                state.start_epoch(ep.epoch)
            for s in range(ep.steps):
                g = ep.layout.rank_window(s, 0).window_samples
                last = state.samples_seen
                state.advance(samples=g, items=g, skipped=False)
                if s == ep.layout.steps_per_epoch - 1:
                    state.start_epoch(ep.epoch + 1)


@settings(max_examples=150, deadline=None)
@given(
    rows=st.integers(20, 400),
    first=st.integers(2, 64),
    later=st.lists(st.tuples(st.integers(1, 600), st.integers(2, 96)), max_size=3),
    ranks=st.integers(1, 3),
    max_steps=st.one_of(st.none(), st.integers(1, 40)),
    epochs=st.one_of(st.none(), st.integers(1, 3)),
    last_window=st.sampled_from(["short", "drop"]),
)
def test_the_length_under_phases_is_the_workers_walk(
    rows, first, later, ranks, max_steps, epochs, last_window
):
    if max_steps is None and epochs is None:
        epochs = 1
    starts = sorted({s for s, _ in later})
    phases = [(0, first)] + [(s, dict(later)[s]) for s in starts]
    phases = [(s, max(g, ranks)) for s, g in phases]  # every rank has a row
    length = RunLength(max_steps, epochs, last_window)
    split = lambda g: resolve_batch_split(num_workers=ranks, global_batch_size=g, uneven=True)  # noqa: E731
    sizes = [(s, g, split(g).micro_batch_size) for s, g in phases]
    assert windows_left(length, rows, TrainState(), sizes, ranks) == _walk(
        length, rows, phases, ranks
    )


def test_a_group_restored_past_a_phases_sample_runs_that_phase(tmp_path):
    # where a resumed (or resized) group starts: the phase of the checkpoint's sample
    from rayacc.worker.phases import BatchPhases

    cfg = TrainConfig.from_dict(
        _with(
            {
                "data": {"source": str(prepare_bundled("digits")), "val_fraction": 0.0},
                "scaling": {"num_workers": [1, 2]},
                "train": {"max_steps": 6},
                "run": {"storage_path": str(tmp_path / "runs")},
            }
        )
    )
    spec = prepare(cfg).spec
    for world in (1, 2):
        phases = BatchPhases(spec, world)
        split, lr = phases.at(TrainState(optimizer_step=2, samples_seen=64))
        assert (split.global_batch_size, lr, phases.phase) == (64, 2e-3, 1)  # linear, from 32
        assert split.grad_accum_steps == 16 // world
        split, lr = phases.at(TrainState(optimizer_step=1, samples_seen=32))
        assert (split.global_batch_size, lr, phases.phase) == (32, 1e-3, 0)


def test_balance_needs_a_strategy_whose_accumulation_may_change():
    refused = {
        "batch": {"global_batch_size": 32, "balance": "auto"},
        "train": {"strategy": "deepspeed"},
    }
    with pytest.raises(ConfigError) as error:
        TrainConfig.from_dict(refused)
    assert "batch.balance" in str(error.value) and "gradient_accumulation_steps" in str(error.value)
    for strategy in ("ddp", "fsdp"):
        TrainConfig.from_dict({**refused, "train": {"strategy": strategy}})
    # a pipeline's schedule is built for one count of micro-steps: a move 8 + 8 → 10 + 6
    # needs 3 where it was built for 2 (it failed at that window)
    piped = {
        "batch": {"global_batch_size": 16, "micro_batch_size": 4, "balance": "auto"},
        "scaling": {"num_workers": 4},
        "model": {"name": "gpt", "n_layer": 2},
        "train": {"strategy": "fsdp", "pipeline_parallel": 2},
    }
    with pytest.raises(ConfigError) as error:
        TrainConfig.from_dict(piped)
    text = str(error.value)
    assert "batch.balance" in text and "train.pipeline_parallel=2" in text, text
    assert "set batch.balance=off, or train.pipeline_parallel=1" in text


AUTO = {
    "batch": {
        "global_batch_size": 32,
        "micro_batch_size": 4,
        "schedule": "auto",
        "min_global_batch_size": 8,
        "max_global_batch_size": 128,
    },
    "scaling": {"num_workers": 2},
    "train": {"epochs": 1},
}
AUTO_REFUSED = {
    "batch.max_global_batch_size": {"batch": {"max_global_batch_size": None}},
    "batch.global_batch_size": {"batch": {"global_batch_size": 256}},
    "train.tensor_parallel": {"train": {"tensor_parallel": 2, "strategy": "fsdp"},
                              "scaling": {"num_workers": 4}},
    "train.max_steps": {"train": {"max_steps": 10}},
    "scaling.num_workers": {"scaling": {"num_workers": 1}},
    "batch.min_global_batch_size": {"batch": {"micro_batch_size": 8}},  # 8 rows on 2 ranks of 8
}  # fmt: skip
"""Each field `auto`'s rules name, and a change of AUTO that makes them name it."""


def _auto(extra: dict) -> dict:
    out = {k: dict(v) for k, v in AUTO.items()}
    for section, values in extra.items():
        out[section] = {**out.get(section, {}), **values}
    return out


@pytest.mark.parametrize("path", AUTO_REFUSED)
def test_what_auto_needs_is_named(path):
    with pytest.raises(ConfigError) as refused:
        TrainConfig.from_dict(_auto(AUTO_REFUSED[path]))
    assert path in str(refused.value) and "Fix:" in str(refused.value), str(refused.value)


@pytest.mark.parametrize("bound", ["min_global_batch_size", "max_global_batch_size"])
def test_auto_s_bounds_without_auto_are_refused_not_ignored(bound):
    with pytest.raises(ConfigError) as refused:
        TrainConfig.from_dict({"batch": {"global_batch_size": 32, bound: 64}})
    assert f"batch.{bound}" in str(refused.value) and "auto only" in str(refused.value)


@pytest.mark.parametrize(
    ("g", "lo", "hi", "sizes"),
    [
        (32, 8, 128, [8, 16, 32, 64, 128]),
        (32, None, 100, [32, 64]),
        (48, 10, 200, [12, 24, 48, 96, 192]),
        (32, 20, 32, [32]),
        (32, 64, 128, []),  # outside its bounds
    ],
)
def test_auto_runs_the_configured_batch_times_the_powers_of_two_within_its_bounds(g, lo, hi, sizes):
    from types import SimpleNamespace

    from rayacc.config.batch_schedule import auto_sizes

    bounds = SimpleNamespace(
        global_batch_size=g, min_global_batch_size=lo, max_global_batch_size=hi
    )
    assert auto_sizes(bounds) == sizes


def _auto_spec(tmp_path):
    cfg = TrainConfig.from_dict(
        _auto(
            {
                "data": {"source": str(prepare_bundled("digits")), "val_fraction": 0.0},
                "optim": {"lr": 0.1, "lr_scaling": "linear"},
                "batch": {"min_global_batch_size": 16},
                "scaling": {"num_workers": [1, 3]},
                "run": {"storage_path": str(tmp_path / "runs")},
            }
        )
    )
    return cfg, prepare(cfg).spec


def test_auto_phases_are_its_sizes_relative_to_the_configured_batch(tmp_path):
    from rayacc.run.quantities import phases_summary

    cfg, spec = _auto_spec(tmp_path)
    assert spec.auto and [p.global_batch_size for p in spec.phases] == [16, 32, 64, 128]
    assert [spec.has_phase(k) for k in (-2, -1, 0, 2, 3)] == [False, True, True, True, False]
    assert spec.split_at(2, -1).global_batch_size == 16 and spec.lr_at(2, -1) == 0.1 / 2
    assert spec.split_at(3, 2).rank_shares == (43, 43, 42) and spec.lr_at(3, 2) == 0.4
    # the phase is the run's (kept by its checkpoints), not the samples'
    state = TrainState(samples_seen=10**6, batch_phase=1)
    assert spec.phase_of(state) == 1 and spec.steps_left(state, 2) is None
    fresh = TrainState(batch_phase=1)
    (epoch,) = spec.epochs_from(fresh, spec.split_at(2, 1), 0)  # no phase's sample bounds it
    assert epoch.steps == epoch.layout.steps_per_epoch == -(-1797 // 64)
    lines = phases_summary(cfg)
    assert lines[0].startswith("batch schedule: auto — from global batch 32, doubled while")
    assert len(lines) == 5 and lines[-1].startswith("batch schedule: auto, global batch 128 ")


def _follower(spec, world: int = 2):
    from types import SimpleNamespace

    from rayacc.engine.noise import NoiseScale
    from rayacc.worker.phases import BatchPhases

    phases = BatchPhases(spec, world)
    state = TrainState()
    split, _ = phases.at(state)
    run = SimpleNamespace(
        state=state,
        split=split,
        telemetry=SimpleNamespace(noise=NoiseScale()),
        accumulate=SimpleNamespace(noise_probe=object()),
    )
    return phases, run


def test_auto_doubles_above_twice_the_batch_halves_below_half_at_most_every_few_windows(tmp_path):
    """The decision after a window, from the smoothed noise scale every rank holds alike: a
    pure function of the run's state and that value, both kept by a checkpoint — so a restored
    group that makes it again (before its first window) decides what the run decided."""
    from rayacc.config.batch_schedule import FOLLOW_EVERY

    _, spec = _auto_spec(tmp_path)
    phases, run = _follower(spec)

    def after(step: int, noise: float | tuple[float, float] | None) -> int:
        run.state.optimizer_step = step
        pair = noise if isinstance(noise, tuple) else (noise, 1.0)
        run.telemetry.noise.smoothed = None if noise is None else pair
        moved = phases._follow(run)
        if moved:
            run.split = spec.split_at(2, run.state.batch_phase)
        return run.state.batch_phase if moved else None

    assert after(FOLLOW_EVERY - 1, 1000.0) is None  # too early
    assert after(FOLLOW_EVERY, None) is None  # nothing measured yet
    assert after(FOLLOW_EVERY, 63.0) is None  # 32 ≤ 63 < 64: holds
    assert after(FOLLOW_EVERY, 64.0) == 1 and run.state.batch_phase_step == FOLLOW_EVERY
    assert after(FOLLOW_EVERY + 5, 10**6) is None  # waits for estimates at its new batch
    assert after(2 * FOLLOW_EVERY, (5.0, -1.0)) == 2  # |G|² below zero: noise dominates
    assert after(3 * FOLLOW_EVERY, 10**6) is None  # 128 is the most
    assert after(3 * FOLLOW_EVERY, 63.9) == 1  # under half of 128
    restored = TrainState(**run.state.state_dict())  # as a checkpoint keeps it
    again, clone = _follower(spec)
    clone.state, clone.split = restored, spec.split_at(2, restored.batch_phase)
    clone.telemetry.noise.smoothed = (1.0, 1.0)
    run.telemetry.noise.smoothed = (1.0, 1.0)
    run.state.optimizer_step = clone.state.optimizer_step = 4 * FOLLOW_EVERY
    assert phases._follow(run) == again._follow(clone) is True
    assert run.state == clone.state and run.state.batch_phase == 0
    # tr Σ below zero: the noise negligible beside the gradient, the batch far above the
    # scale: halved, never doubled (the ratio alone, −5, reads as "doubled")
    assert after(5 * FOLLOW_EVERY, (-5.0, 1.0)) == -1
    assert after(6 * FOLLOW_EVERY, (-5.0, -1.0)) is None  # both below zero: no estimate
    run.accumulate.noise_probe = None  # a group of one rank measures none: it holds
    run.state.optimizer_step, run.telemetry.noise.smoothed = 9 * FOLLOW_EVERY, (10**6, 1.0)
    assert not phases._follow(run)


@pytest.mark.parametrize(
    ("trace", "square", "move"),
    [
        (300.0, 1.0, 1),  # B_simple 300 ≥ 2 × 100
        (150.0, 1.0, 0),
        (40.0, 1.0, -1),  # under half
        (5.0, -1.0, 1),  # the gradient buried in its noise
        (-5.0, 1.0, -1),  # the noise negligible: B_simple ≈ 0
        (-5.0, -1.0, 0),  # no estimate
        (0.0, 1.0, -1),
        (0.0, 0.0, 0),
    ],
)
def test_the_noise_scales_move_reads_each_estimates_sign(trace, square, move):
    """`NoiseScale.move`: the ratio where both estimates are positive; a negative one decides
    by its sign, not by the ratio's (tr Σ < 0 gives a negative ratio: the batch is far above
    the scale, never below it)."""
    from rayacc.engine.noise import NoiseScale

    noise = NoiseScale()
    assert noise.move(100) == 0  # nothing measured
    noise.smoothed = (trace, square)
    assert noise.move(100) == move
