"""The planner without a cluster: candidates, the prior and its pruning, the choice, and the
plan file's round trip into a config (rayacc/planner)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rayacc.config import ConfigError, TrainConfig
from rayacc.planner.candidates import Candidate, checkpointing_choices, enumerate_candidates
from rayacc.planner.planfile import PlanFile, made_for
from rayacc.planner.prior import Placement, predict
from rayacc.planner.profile import Curve, Profile
from rayacc.planner.search import PlanRow, pick, profile_for, profile_sizes, worker_counts
from rayacc.run.quantities import split_at
from tests.support.services.cli import rayacc_here

ROOT = Path(__file__).resolve().parents[3]
MIB = 2**20


@pytest.mark.parametrize(
    "global_batch, counts, blocks, expect_n, skipped",
    [
        # mlp: no checkpointing choices; from 2 workers fsdp in each sync mode and offloaded
        (256, [1, 2], 0, 9 + 8 * 4, 0),
        (64, [1, 2], 4, (7 + 6 * 4) * 3, 0),  # gpt with 4 blocks: none, every 2nd, full
        (64, [1, 2, 3], 2, (7 + 6 * 4) * 2, 1),  # 3 does not divide 64
        (6, [4], 1, 0, 1),
    ],
)
def test_every_candidate_keeps_the_global_batch(global_batch, counts, blocks, expect_n, skipped):
    cands, why = enumerate_candidates(global_batch, counts, blocks)
    assert len(cands) == expect_n and len(why) == skipped
    assert all(c.global_batch_size == global_batch for c in cands)
    assert not any(c.strategy == "fsdp" and c.workers == 1 for c in cands)
    assert len({c.label for c in cands}) == len(cands), "labels name candidates uniquely"
    if skipped:
        assert "does not split evenly" in why[0]


def test_hsdp_is_a_candidate_where_the_workers_span_nodes():
    """2 workers a node: 4 workers span 2 nodes (HSDP 2×2 in both sync modes), 3 span 2
    unevenly (none), 2 fit on one (none)."""
    cands, _ = enumerate_candidates(24, [2, 3, 4], 0, workers_per_node=2)
    hsdp = {(c.workers, c.strategy_label) for c in cands if c.replicate > 1}
    assert hsdp == {(4, "fsdp every_micro_step hsdp 2×2"), (4, "fsdp window_end hsdp 2×2")}
    offload = {c.strategy_label for c in cands if c.offload}
    assert offload == {"fsdp every_micro_step offload"}
    (c,) = [
        c
        for c in cands
        if c.replicate > 1 and c.micro_batch_size == 6 and c.grad_sync == "window_end"
    ]
    over = c.overrides()
    assert (over["fsdp.replicate"], over["fsdp.offload"], over["train.strategy"]) == (
        2,
        "none",
        "fsdp",
    )
    # HSDP pays FSDP's measured fixed costs in its sync mode
    assert c.overhead_label == f"fsdp {c.grad_sync}"
    # what the candidate sets, the config takes
    TrainConfig.from_dict(
        {"batch": {"global_batch_size": 24}}, [f"{k}={v}" for k, v in over.items()]
    )


def test_checkpointing_is_only_tried_where_there_are_blocks():
    assert checkpointing_choices(0) == ["none"]
    assert checkpointing_choices(2) == ["none", "full"]
    assert checkpointing_choices(6) == ["none", 2, "full"]


def _profile(**kw) -> Profile:
    """A made-up profile: 1 MiB of parameters in 4 units, compute 10 ms + 1 ms per sample,
    activations 0.1 MiB per sample."""
    base = dict(
        device="cpu",
        world=2,
        param_bytes=1 * MIB,
        units=4,
        largest_unit_bytes=MIB // 4,
        optimizer_slots=2,
        compute_s={
            "none": Curve([1, 64], [0.011, 0.074]),
            "full": Curve([1, 64], [0.015, 0.100]),
        },
        activation_bytes={
            "none": Curve([1, 64], [0.1 * MIB, 6.4 * MIB]),
            "full": Curve([1, 64], [0.02 * MIB, 1.28 * MIB]),
        },
        optimizer_s=0.004,
        allreduce_s_per_byte=1e-8,
        gather_s_per_byte=0.5e-8,
        latency_s=1e-4,
        memory_bytes=0,
    )
    base.update(kw)
    return Profile(**base)


def test_the_prior_knows_which_collectives_cross_nodes():
    """4 workers on 2 nodes over a slow link: FSDP's every-micro-step gathers and
    reduce-scatters cross it, HSDP's stay inside a node (only its one all-reduce per window
    crosses), so HSDP is the faster, at the memory of shards over 2 ranks instead of 4."""
    p = _profile(world=4)
    slow = Placement(workers_per_node=2, inter_node_gbps=0.1)
    fsdp = Candidate(4, 2, 4, "fsdp", "every_micro_step")
    hsdp = Candidate(4, 2, 4, "fsdp", "every_micro_step", replicate=2)
    f, h = predict(fsdp, p, placement=slow), predict(hsdp, p, placement=slow)
    assert h.comm_s < f.comm_s / 3, (h.comm_s, f.comm_s)
    # 1 MiB over 0.1 Gbit/s: 4 micro-steps × (2 gathers + a reduce-scatter) × 3/4 of it
    assert f.comm_s == pytest.approx(4 * 3 * MIB * 0.75 * 8 / 0.1e9, rel=0.01)
    # HSDP: its shard (1/2 MiB) all-reduced across the 2 nodes once, at the link's rate
    # instead of the profile's (1e-8 s a byte at 4 ranks, scaled to a ring of 2)
    link, measured = 0.5 * 8 / 0.1e9, 1e-8 * 0.5 / 0.75
    assert h.comm_s - predict(hsdp, p).comm_s == pytest.approx(0.5 * MIB * (link - measured))
    assert h.memory_bytes - f.memory_bytes == pytest.approx(4 * MIB / 2 - 4 * MIB / 4)
    # on one node nothing crosses: the link is no one's bound
    assert predict(fsdp, p, placement=Placement(4, 0.1)).comm_s == predict(fsdp, p).comm_s


def test_fsdp_offload_spares_device_memory_for_host_copies_on_a_gpu():
    p = _profile(device="cuda")
    on, off = (
        predict(Candidate(2, 16, 2, "fsdp", "every_micro_step", offload=o), p) for o in (1, 0)
    )
    # the shards of parameters, gradients and 2 AdamW slots (4 × 1/2 MiB) in host memory
    assert off.memory_bytes - on.memory_bytes == pytest.approx(4 * MIB / 2)
    assert on.comm_s > off.comm_s
    # on a CPU worker the host is the device: nothing spared, nothing copied
    cpu = _profile()
    assert predict(Candidate(2, 16, 2, "fsdp", "every_micro_step", offload=True), cpu) == predict(
        Candidate(2, 16, 2, "fsdp", "every_micro_step"), cpu
    )


def test_the_prior_counts_each_strategys_memory():
    p = _profile()
    mem = {
        label: predict(Candidate(2, 16, 2, s, g), p).memory_bytes / MIB
        for label, s, g in [
            ("ddp", "ddp", None),
            ("every", "fsdp", "every_micro_step"),
            ("window_end", "fsdp", "window_end"),
        ]
    }
    acts = 1.6  # 16 samples × 0.1 MiB
    assert mem["ddp"] == pytest.approx(4 + acts)  # params, grads, 2 AdamW slots
    # shards of 3 of the 4, whole gradients under window_end, plus the gathered weights
    assert mem["every"] == pytest.approx(4 / 2 + 1 + acts)
    assert mem["window_end"] == pytest.approx(3 / 2 + 1 + 1 + acts)
    # on a GPU with resharding only the two largest units are gathered at once
    gpu = predict(Candidate(2, 16, 2, "fsdp", "every_micro_step"), _profile(device="cuda"))
    assert gpu.memory_bytes / MIB == pytest.approx(4 / 2 + 0.5 + acts)
    # a recomputed block keeps no gathered weights from its forward (the CPU count)
    blocks = _profile(block_bytes=[MIB // 5] * 4)
    recomputed = predict(Candidate(2, 16, 2, "fsdp", "every_micro_step", "full"), blocks)
    acts_full = 16 * 0.02
    assert recomputed.memory_bytes / MIB == pytest.approx(4 / 2 + (1 - 0.8) + acts_full)
    every_2nd = predict(Candidate(2, 16, 2, "fsdp", "every_micro_step", 2), blocks)
    assert every_2nd.fits is False, "no profile of every 2nd block: pruned"
    # checkpointing trades activations for recompute time
    full = predict(Candidate(2, 16, 2, checkpointing="full"), p)
    none = predict(Candidate(2, 16, 2), p)
    assert full.memory_bytes < none.memory_bytes and full.step_s > none.step_s


def test_the_prior_counts_each_strategys_communication():
    p = _profile()
    one = predict(Candidate(1, 16, 4), p)
    assert one.comm_s == 0.0, "one worker communicates nothing"
    ddp = predict(Candidate(2, 16, 2), p)
    assert ddp.comm_s == pytest.approx(1e-4 + MIB * 1e-8)  # one all-reduce per window
    every = predict(Candidate(2, 16, 2, "fsdp", "every_micro_step"), p)
    window_end = predict(Candidate(2, 16, 2, "fsdp", "window_end"), p)
    gather = MIB * 0.5e-8 + 4 * 1e-4
    assert every.comm_s == pytest.approx(2 * (2 * gather + gather))
    assert window_end.comm_s == pytest.approx(2 * 2 * gather + gather)
    # more ranks in the ring: each moves (n-1)/n of the bytes
    four = predict(Candidate(4, 8, 2), p)
    assert four.comm_s == pytest.approx(1e-4 + MIB * 1e-8 * (3 / 4) / (1 / 2))
    # the measured fixed costs are added per window and per micro-step
    costly = predict(Candidate(2, 16, 2), _profile(overheads={"ddp": [0.01, 0.002]}))
    assert costly.step_s == pytest.approx(ddp.step_s + 0.01 + 2 * 0.002)


PRUNING = [
    # (candidate, profile changes, fits, why contains)
    (Candidate(2, 16, 2), {}, True, None),
    (Candidate(2, 64, 1), {"memory_bytes": 8 * MIB}, False, "the budget is 8.00 MiB"),
    (Candidate(2, 64, 1, "fsdp", "every_micro_step"), {"memory_bytes": 8 * MIB}, False, "MiB"),
    (Candidate(2, 64, 1, checkpointing="full"), {"memory_bytes": 8 * MIB}, True, None),
    (Candidate(2, 32, 1), {"failed": {"none": 32}}, False, "ran out of memory in the profile"),
    (Candidate(2, 16, 2), {"failed": {"none": 32}}, True, None),
    (Candidate(2, 16, 2, checkpointing=2), {}, False, "out of memory in the profile"),
]


@pytest.mark.parametrize("c, changes, fits, why", PRUNING)
def test_the_prior_prunes_what_cannot_fit(c, changes, fits, why):
    pred = predict(c, _profile(**changes))
    assert pred.fits is fits
    if why:
        assert why in pred.why_not


def test_the_pick_is_the_fastest_measured_else_the_fastest_predicted_that_fits():
    p = _profile(memory_bytes=6 * MIB)
    rows = [PlanRow(c, predict(c, p)) for c in enumerate_candidates(64, [1, 2], 0)[0]]
    fitting = [r for r in rows if r.prediction.fits]
    assert 0 < len(fitting) < len(rows)
    by_prior = pick(rows)
    assert by_prior.prediction.fits
    assert by_prior.prediction.step_s == min(r.prediction.step_s for r in fitting)
    slow, fast = fitting[0], fitting[-1]
    slow.measured = {"status": "measured", "step_s": 0.5, "memory_bytes": 1.0}
    fast.measured = {"status": "measured", "step_s": 0.2, "memory_bytes": 1.0}
    fitting[1].measured = {"status": "out of memory"}
    assert pick(rows) is fast
    assert fast.time_error == pytest.approx(fast.prediction.step_s / 0.2 - 1)


def test_profile_sizes_and_worker_counts():
    assert profile_sizes([1, 2, 4, 8, 16, 32, 64]) == [1, 8, 64]
    assert profile_sizes([4, 8]) == [4, 8]
    cfg = TrainConfig.from_dict({"batch": {"global_batch_size": 8}, "scaling": {"num_workers": 4}})
    assert worker_counts(cfg, None) == [1, 2, 3, 4]
    assert worker_counts(cfg, 2) == [1, 2], "no more than the cluster holds"
    elastic = TrainConfig.from_dict(
        {"batch": {"global_batch_size": 8}, "scaling": {"num_workers": [2, 4]}}
    )
    assert worker_counts(elastic, None) == [2, 3, 4]
    profiles = {2: _profile(), 1: _profile(world=1)}
    assert profile_for(profiles, 1).world == 1 and profile_for(profiles, 4).world == 2


# ----------------------------------------------------------------------------- the plan file
def _job(**changes) -> dict:
    data = yaml.safe_load((ROOT / "jobs/digits.yaml").read_text())
    for key, value in changes.items():
        section, name = key.split(".")
        data[section][name] = value
    return data


def _plan(job: dict, chosen: Candidate, by_workers=None) -> PlanFile:
    cfg = TrainConfig.from_dict(job)
    return PlanFile(
        job="jobs/digits.yaml",
        made_for=made_for(cfg),
        chosen=chosen,
        by_workers=by_workers or {chosen.workers: chosen},
        candidates=[{"label": chosen.label, "predicted_step_s": 0.01}],
        profile=_profile().to_dict(),
    )


CHOSEN = [
    Candidate(1, 128, 2),
    Candidate(2, 32, 4, "fsdp", "window_end"),
    Candidate(2, 64, 2, "fsdp", "every_micro_step"),
]


@pytest.mark.parametrize("chosen", CHOSEN, ids=lambda c: c.label)
def test_a_plan_file_round_trips_into_the_config_it_chose(tmp_path, chosen):
    job = _job()
    path = _plan(job, chosen).write(tmp_path / "plans" / "PLAN.yaml")
    back = PlanFile.read(path)
    assert back.chosen == chosen and back.by_workers == {chosen.workers: chosen}
    assert back.profile == _profile().to_dict()
    assert Profile.from_dict(back.profile).compute_s["none"].at(32) == pytest.approx(0.042)
    cfg = TrainConfig.from_dict(job, back.overrides_for(TrainConfig.from_dict(job)))
    plan = cfg.batch_split()
    assert (plan.num_workers, plan.micro_batch_size, plan.grad_accum_steps) == (
        chosen.workers,
        chosen.micro_batch_size,
        chosen.grad_accum_steps,
    )
    assert plan.global_batch_size == 256, "the plan keeps the job's global batch"
    assert cfg.train.strategy == chosen.strategy
    if chosen.grad_sync:
        assert cfg.fsdp.grad_sync == chosen.grad_sync
    # the file says how to run it, and nothing is left half-written beside it
    assert "--plan" in path.read_text().splitlines()[0]
    assert [p.name for p in path.parent.iterdir()] == ["PLAN.yaml"]


def test_a_plan_of_another_strategy_puts_the_jobs_strategy_settings_back(tmp_path):
    """An FSDP job's `fsdp.grad_sync` stands in a DDP plan's way (another strategy's setting is
    refused): the plan's overrides put it back to its default."""
    job = _job(**{"train.strategy": "fsdp"})
    job["fsdp"] = {"grad_sync": "window_end"}
    path = _plan(job, Candidate(1, 128, 2)).write(tmp_path / "PLAN.yaml")
    overrides = PlanFile.read(path).overrides_for(TrainConfig.from_dict(job))
    assert "fsdp.grad_sync=every_micro_step" in overrides
    cfg = TrainConfig.from_dict(job, overrides)
    assert cfg.train.strategy == "ddp" and cfg.fsdp.grad_sync == "every_micro_step"


@pytest.mark.parametrize(
    "change, field",
    [
        ({"batch.global_batch_size": 128}, "global_batch_size"),
        ({"model.hidden_sizes": [64]}, "model"),
        ({"train.precision": "bf16"}, "train.precision"),
        ({"optim.name": "sgd"}, "optim.name"),
        ({"data.source": "shakespeare"}, "data.source"),
    ],
)
def test_a_plan_for_another_job_is_refused_naming_what_differs(change, field):
    plan = _plan(_job(), CHOSEN[0])
    with pytest.raises(ConfigError) as err:
        plan.overrides_for(TrainConfig.from_dict(_job(**change)), "jobs/digits.yaml")
    assert err.value.issues[0].path == field
    assert "rayacc plan" in str(err.value)


@pytest.mark.parametrize(
    "text, what",
    [
        ("just text", "rayacc_plan"),
        ("rayacc_plan: 1\nmade_for: {}\n", "chosen"),
        ("rayacc_plan: 7\n", "rayacc_plan"),
    ],
)
def test_a_file_that_is_not_a_plan_is_a_clear_error(tmp_path, text, what):
    path = tmp_path / "PLAN.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        PlanFile.read(path)
    assert what in str(err.value) and str(path) in str(err.value)


def test_an_elastic_job_takes_each_sizes_micro_batch_from_the_plan():
    job = _job(**{"scaling.num_workers": [1, 2]})
    by_workers = {1: Candidate(1, 64, 4), 2: Candidate(2, 32, 4)}
    plan = _plan(job, by_workers[2], by_workers)
    overrides = plan.overrides_for(TrainConfig.from_dict(job))
    assert not any(o.startswith("scaling.num_workers") for o in overrides)
    cfg = TrainConfig.from_dict(job, overrides)
    assert cfg.batch.micro_batch_by_workers == {1: 64, 2: 32}
    # a resize to one worker runs the plan's 64 × 4, not the 32 × 8 derived without it
    one = split_at(cfg, 1)
    assert (one.micro_batch_size, one.grad_accum_steps, one.global_batch_size) == (64, 4, 256)
    two = split_at(cfg, 2)
    assert (two.micro_batch_size, two.grad_accum_steps) == (32, 4)
    without = TrainConfig.from_dict(job, ["batch.micro_batch_size=32"])
    assert split_at(without, 1).micro_batch_size == 32


def test_a_planned_micro_batch_that_breaks_the_global_batch_names_the_field():
    job = _job(**{"scaling.num_workers": [1, 2]})
    # refused where the config is read: the run would stop on reaching one worker
    with pytest.raises(ConfigError, match="batch.micro_batch_by_workers: micro-batch 96 at 1"):
        TrainConfig.from_dict(job, ["batch.micro_batch_by_workers={1: 96}"])


@pytest.mark.parametrize(
    "scaling, warned",
    [
        ({"num_workers": [1, 2]}, False),
        ({"num_workers": 2}, True),  # not elastic: nothing resizes
        ({"num_workers": [1, 2], "on_resize": "keep_micro_batch"}, True),
    ],
)
def test_planned_sizes_a_run_cannot_use_are_warned_of(scaling, warned, tmp_path):
    from rayacc.driver.prelaunch import prepare

    job = _job(**{f"scaling.{k}": v for k, v in scaling.items()})
    job["data"]["cache_dir"] = str(tmp_path)
    cfg = TrainConfig.from_dict(job, ["batch.micro_batch_by_workers={1: 64, 2: 32}"])
    said = [w for w in prepare(cfg).warnings if "micro_batch_by_workers" in w]
    assert bool(said) is warned, said


# ----------------------------------------------------------------------------- the probe


# ----------------------------------------------------------------------------- sweeps from a plan
def _plan_with_rows(job: dict) -> PlanFile:
    rows = [
        # a measured slower one, a measured faster one, a predicted-only one, one pruned
        (Candidate(2, 32, 4), {"measured_step_s": 0.020, "predicted_step_s": 0.010}),
        (Candidate(1, 128, 2), {"measured_step_s": 0.010, "predicted_step_s": 0.012}),
        (Candidate(2, 64, 2, "fsdp", "window_end"), {"predicted_step_s": 0.015}),
        (Candidate(2, 128, 1), {"predicted_step_s": 0.001, "fits": False}),
    ]
    plan = _plan(job, rows[1][0])
    plan.candidates = [
        {"label": c.label, **c.to_dict(), "predicted_memory_mb": 1.5, "fits": True, **r}
        for c, r in rows
    ]
    return plan


def test_a_sweep_from_a_plan_runs_its_best_candidates_with_their_predictions(tmp_path):
    from rayacc.config import SweepConfig
    from rayacc.driver.sweep import expand_trials

    _plan_with_rows(_job()).write(tmp_path / "PLAN.yaml")
    spec = {"base": str(ROOT / "jobs/digits.yaml"), "plan": "PLAN.yaml", "from_plan": 3}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    sweep, base, _ = SweepConfig.from_yaml(tmp_path / "sweep.yaml")
    assert sweep.plan == str(tmp_path / "PLAN.yaml"), "relative to the sweep file"
    trials = expand_trials(sweep, base)
    assert [t.skip_reason for t in trials] == [None] * 3
    got = [
        (t.config["scaling"]["num_workers"], t.config["batch"]["micro_batch_size"]) for t in trials
    ]
    assert got == [(1, 128), (2, 32), (2, 64)], "measured fastest first, then by the prior"
    assert trials[2].config["train"]["strategy"] == "fsdp"
    assert trials[2].config["fsdp"]["grad_sync"] == "window_end"
    assert all(
        TrainConfig.model_validate(t.config).batch_split().global_batch_size == 256 for t in trials
    )
    assert trials[0].predicted == {"predicted_step_s": 0.012, "predicted_memory_mb": 1.5}


@pytest.mark.parametrize(
    "spec, names",
    [
        ({"from_plan": 2}, ["plan", "from_plan needs the plan file"]),
        ({"plan": "PLAN.yaml"}, ["from_plan", "from_plan: 3"]),
        (
            {"plan": "PLAN.yaml", "from_plan": 2, "grid": {"batch.micro_batch_size": [8]}},
            ["from_plan", "remove `grid`"],
        ),
        ({"plan": "PLAN.yaml", "from_plan": 0}, ["from_plan"]),
    ],
)
def test_a_sweep_file_with_a_plan_is_checked_before_any_trial(tmp_path, spec, names):
    from rayacc.config import SweepConfig

    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": str(ROOT / "jobs/digits.yaml"), **spec}))
    with pytest.raises(ConfigError) as err:
        SweepConfig.from_yaml(path)
    for name in names:
        assert name in str(err.value), (name, str(err.value))


def test_a_sweep_from_a_plan_for_another_job_is_refused(tmp_path):
    from rayacc.config import SweepConfig
    from rayacc.driver.sweep import expand_trials

    _plan_with_rows(_job(**{"batch.global_batch_size": 128})).write(tmp_path / "PLAN.yaml")
    spec = {"base": str(ROOT / "jobs/digits.yaml"), "plan": "PLAN.yaml", "from_plan": 2}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    sweep, base, _ = SweepConfig.from_yaml(tmp_path / "sweep.yaml")
    with pytest.raises(ConfigError, match="global_batch_size"):
        expand_trials(sweep, base)


def test_the_sweep_report_sets_the_prior_beside_the_trials():
    import math

    from rayacc.tracking.report import Report, TrialRow

    def row(trial, predicted, measured):
        return TrialRow(
            trial, "r" + trial, "FINISHED", 2, 32, 4, 256, 0.006, 0.25, 0.9, "val/accuracy",
            1000.0, 500.0, 0.1, 10.0, predicted_step_s=predicted, predicted_memory_mb=1.5,
            step_s=measured,
        )  # fmt: skip

    report = Report("parent", [row("0", 0.011, 0.010), row("1", 0.018, 0.020)])
    (line,) = report.plan_lines()
    assert "median |step-time error| 10%" in line
    assert "trial 0 (micro 32 × accum 4 × 2 worker(s)): step 0.011 s predicted" in line
    assert "0.01 s measured (+10%)" in line and "(-10%)" in line
    assert any("the plan's prior" in v for v in report.verdict())
    plain = Report("parent", [row("0", math.nan, 0.01)])
    assert plain.plan_lines() == [] and not any("prior" in v for v in plain.verdict())


def test_the_profile_in_one_process_and_a_model_that_fits_only_when_recomputed(tmp_path):
    """The profile and the fixed costs, measured in this process (one rank, no collectives):
    positive times and memory growing with the micro-batch; when only a checkpointing setting
    fitted, the fixed costs are measured with it; when nothing fitted, there are none."""
    import torch

    from rayacc.data.sources import describe_dataset
    from rayacc.driver.calibrate import measure_overheads, sample_rows
    from rayacc.planner.profile import measure_profile

    job = _job()
    job["data"]["cache_dir"] = str(tmp_path)
    cfg = TrainConfig.from_dict(job)
    info = describe_dataset("digits", str(tmp_path))
    rows = sample_rows(info, 64)
    cpu = torch.device("cpu")
    profile = measure_profile(
        cfg, info, rows, sizes=[8, 32], checkpointings=["none"], device=cpu, rank=0,
        memory_bytes=0,
    )  # fmt: skip
    assert profile.world == 1 and profile.allreduce_s_per_byte == 0.0
    assert all(t > 0 for t in profile.compute_s["none"].values)
    assert profile.activation_bytes["none"].at(32) > profile.activation_bytes["none"].at(8)
    assert profile.param_bytes == 104488 and profile.items_per_sample == 1.0
    overheads = measure_overheads(cfg, info, rows, profile, rank=0, device=cpu, world=1)
    assert set(overheads) == {"ddp"} and all(v >= 0 for v in overheads["ddp"])
    for key in ("compute_s", "activation_bytes"):
        getattr(profile, key)["full"] = getattr(profile, key).pop("none")
    assert set(measure_overheads(cfg, info, rows, profile, rank=0, device=cpu, world=1)) == {"ddp"}
    profile.compute_s.clear()
    assert measure_overheads(cfg, info, rows, profile, rank=0, device=cpu, world=1) == {}


def test_a_plan_for_another_job_is_a_user_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    job = ROOT / "jobs/digits.yaml"
    other = TrainConfig.from_yaml(job, ["batch.global_batch_size=128"])
    chosen = Candidate(2, 16, 4)
    PlanFile("jobs/digits.yaml", made_for(other), chosen, {2: chosen}).write("P.yaml")
    ran = rayacc_here(["train", "-c", str(job), "--plan", "P.yaml"], capsys, monkeypatch)
    assert ran.code == 2
    assert "global_batch_size" in ran.err and "rayacc plan" in ran.err
    assert "Traceback" not in ran.err


def test_the_search_samples_rows_of_a_folder_dataset_as_every_reader_does(tmp_path):
    """`rayacc data prepare --out DIR` writes a folder of Parquet files; the planner's sample of
    one global batch reads it through the one reader of rows (it opened the path as one file)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rayacc.data.sources import describe_dataset
    from rayacc.driver.calibrate import sample_rows

    folder = tmp_path / "tokens"
    folder.mkdir()
    rows = np.arange(90, dtype=np.int64).reshape(30, 3)
    for i in range(3):  # three files of ten rows, each in row groups of four
        part = pa.table(
            {"tokens": pa.array(list(rows[10 * i : 10 * i + 10]), pa.list_(pa.int64()))}
        )
        pq.write_table(part, folder / f"part-{i}.parquet", row_group_size=4)
    info = describe_dataset(str(folder))
    got = sample_rows(info, 14)
    assert len(got) == 14
    assert got.take(np.arange(14))["input"].tolist() == rows[:14, :2].tolist()
    assert len(sample_rows(info, 100)) == 30  # a batch larger than the data: all of it


def _row(label_micro: int, memory_mb: float, fits: bool, measured: str | None = None):
    from rayacc.planner.prior import Prediction
    from rayacc.planner.search import PlanRow

    why = None if fits else f"needs {memory_mb} MiB per rank, the budget is 100 MiB"
    result = None
    if measured == "measured":
        result = {"status": "measured", "memory_bytes": memory_mb * 2**20, "step_s": 0.1}
    elif measured:
        result = {"status": measured}
    return PlanRow(
        Candidate(2, label_micro, 64 // (2 * label_micro)),
        Prediction(memory_mb * 2**20, 0.1, 0.1, 0.0, fits, why),
        result,
    )


@pytest.mark.parametrize(
    ("rows", "outcome"),
    [
        # none fits by the prior: the smallest need is named against the budget
        ([(32, 400, False), (16, 250, False)], "2w 16×2 ddp ac=none, needs 250 MiB"),
        # the prior said two fit; calibrated, both ran out of memory, none left to try
        (
            [(8, 90, True, "out of memory"), (4, 60, True, "over budget"), (16, 250, False)],
            "2w 4×8 ddp ac=none, over budget",
        ),
        # one measured: a plan
        ([(8, 90, True, "measured"), (4, 60, True, "out of memory")], None),
        # the time budget ran out before any was measured: the prior's pick stands
        ([(8, 90, True), (4, 60, True)], None),
        # one failed, another the prior says fits was not reached
        ([(8, 90, True, "out of memory"), (4, 60, True)], None),
    ],
)
def test_nothing_fits_is_an_outcome_that_writes_no_plan(rows, outcome):
    from rayacc.planner.search import NothingFits, nothing_fits

    found = nothing_fits([_row(*r) for r in rows])
    if outcome is None:
        assert found is None
        return
    assert isinstance(found, NothingFits)
    message = str(found)
    assert outcome in message and "no plan written" in message and "Fix:" in message


class _Group:
    """The calibration group's surface as `search` calls it: a made-up profile, and candidates
    measured in order until `reached` of them are done (where a real group's deadline falls)."""

    groups_started = 1

    def __init__(self, reached: int):
        self.reached, self.done = reached, {}

    def profile(self, workers, sizes, choices):
        return _profile(world=workers)

    def measure(self, workers, todo, deadline):
        for key, _ in todo[: self.reached - len(self.done)]:
            self.done[key] = {"status": "measured", "memory_bytes": MIB, "step_s": 0.05}

    def results(self):
        return self.done


@pytest.mark.parametrize(("reached", "said"), [(2, None), (1, "with 1 of 2"), (0, "with 0 of 2")])
def test_a_time_budget_that_runs_out_before_the_top_candidates_is_said(tmp_path, reached, said):
    from types import SimpleNamespace

    from rayacc.data.sources import describe_dataset
    from rayacc.planner.search import search

    job = _job()
    job["data"]["cache_dir"] = str(tmp_path)
    cfg = TrainConfig.from_dict(job)
    prep = SimpleNamespace(
        info=describe_dataset("digits", str(tmp_path)),
        split=SimpleNamespace(global_batch_size=256),
    )
    lines: list[str] = []
    result = search(
        cfg, prep, _Group(reached), budget_s=30, top=2, cluster_holds=2, say=lines.append
    )
    assert len(result.measured) == reached
    late = [line for line in lines if "time budget" in line]
    if said is None:
        assert late == [], lines
    else:
        (line,) = late
        assert said in line and "(30 s)" in line and "raise --budget-s" in line, line


def test_a_deepspeed_job_plans_each_zero_mode_from_two_workers():
    """The ZeRO modes are candidates of a DeepSpeed job only; each candidate's overrides make a
    valid config of the job (the one validator)."""
    plain, _ = enumerate_candidates(64, [1, 2], 0)
    cands, _ = enumerate_candidates(64, [1, 2], 0, job_strategy="deepspeed")
    zero = [c for c in cands if c.strategy == "deepspeed"]
    assert not any(c.strategy == "deepspeed" for c in plain)
    assert len(zero) == 5 * 6 and all(c.workers == 2 for c in zero)  # 5 modes × micro 1..32
    assert {c.strategy_label for c in zero} == {
        "deepspeed zero1",
        "deepspeed zero2",
        "deepspeed zero3",
        "deepspeed zero2 offload",
        "deepspeed zero3 offload",
    }
    job = {
        "batch": {"global_batch_size": 64, "micro_batch_size": 32},
        "scaling": {"num_workers": 2},
        "train": {"strategy": "deepspeed"},
    }
    for c in zero:
        cfg = TrainConfig.from_dict(job, [f"{k}={v}" for k, v in c.overrides().items()])
        assert cfg.deepspeed.stage == c.zero_stage
        assert cfg.deepspeed.offload_optimizer == ("cpu" if c.offload else "none")
        assert Candidate.from_dict(c.to_dict()) == c


def test_the_prior_counts_each_zero_stages_memory_and_communication():
    """1 MiB of parameters, AdamW's 2 slots, 2 ranks: ZeRO-1 holds the parameters and
    gradients whole and a half of the fp32 master and state; ZeRO-2 half of the gradients;
    ZeRO-3 half of everything and the gathered weights; offload spares a GPU the master and
    state. ZeRO-1 all-reduces once per window, ZeRO-2 reduces every micro-step, ZeRO-3 gathers
    and reduce-scatters every micro-step."""
    p = _profile()
    acts = 1.6

    def zero(stage, offload=False, profile=p):
        return predict(Candidate(2, 16, 2, "deepspeed", zero_stage=stage, offload=offload), profile)

    assert zero(1).memory_bytes / MIB == pytest.approx(1 + 1 + 3 / 2 + acts)
    assert zero(2).memory_bytes / MIB == pytest.approx(1 + 1 / 2 + 3 / 2 + acts)
    assert zero(3).memory_bytes / MIB == pytest.approx(1 / 2 + 1 / 2 + 3 / 2 + 1 + acts)
    gpu = _profile(device="cuda")
    assert zero(3, True, gpu).memory_bytes / MIB == pytest.approx(1 / 2 + 1 / 2 + 0.5 + acts)
    assert zero(2, True, gpu).memory_bytes < zero(2, False, gpu).memory_bytes
    assert zero(2, True).memory_bytes == zero(2).memory_bytes, "on a CPU the host is the device"
    gather = MIB * 0.5e-8 + 4 * 1e-4
    assert zero(1).comm_s == pytest.approx(1e-4 + MIB * 1e-8)
    assert zero(2).comm_s == pytest.approx(3 * (MIB * 0.5e-8 + 1e-4))
    assert zero(3).comm_s == pytest.approx(2 * (2 * gather + gather))


def test_tensor_parallel_candidates_keep_the_global_batch_on_one_node():
    """Groups of 2 and 4 the model takes: at 4 workers with 2 a node only groups of 2 (a
    group's all-reduces run every layer: never across nodes), under FSDP alone (DDP and ZeRO do
    not compose with it); the global batch splits over the data-parallel ranks."""
    cands, _ = enumerate_candidates(64, [2, 4], 2, tensor_parallel=[2, 4], workers_per_node=2)
    tp = {(c.workers, c.tensor_parallel, c.strategy) for c in cands if c.tensor_parallel > 1}
    assert tp == {(2, 2, "fsdp"), (4, 2, "fsdp")}
    assert all(c.global_batch_size == 64 for c in cands)
    (c,) = [
        c
        for c in cands
        if (c.workers, c.tensor_parallel, c.micro_batch_size, c.grad_sync, c.checkpointing)
        == (4, 2, 8, "window_end", "none")
        and c.replicate == 1
    ]
    assert (c.data_parallel, c.grad_accum_steps, c.label) == (
        2,
        4,
        "4w 8×4 fsdp window_end tp2 ac=none",
    )
    over = c.overrides()
    assert (over["train.tensor_parallel"], over["scaling.num_workers"]) == (2, 4)
    one_node, _ = enumerate_candidates(64, [4], 2, tensor_parallel=[2, 4])
    assert {c.tensor_parallel for c in one_node} == {1, 2, 4}
    assert enumerate_candidates(64, [4], 2)[0] == [c for c in one_node if c.tensor_parallel == 1]


def test_the_prior_splits_a_tensor_parallel_candidates_share_and_keeps_its_all_reduces_on_a_node():
    from rayacc.planner.prior import TensorPlan

    p = _profile(world=4)
    plan = TensorPlan(split=0.75, allreduces=8, bytes_per_sample=1000.0)
    fsdp = Candidate(4, 8, 2, "fsdp", "every_micro_step")
    tp = Candidate(4, 16, 2, "fsdp", "every_micro_step", tensor_parallel=2)  # same global batch
    f, t = predict(fsdp, p), predict(tp, p, tensor_plan=plan)
    keep = 0.25 + 0.75 / 2
    # each rank computes its share of twice the micro-batch
    assert t.compute_s == pytest.approx(2 * p.compute_s["none"].at(16) * keep)
    assert t.compute_s < 2 * f.compute_s
    # the group's all-reduces, at the profile's rate scaled to 2 ranks, whatever the links
    # between nodes
    tp_comm = 2 * (16 * 1000.0 * 1e-8 * (1 / 2) / (3 / 4) + 8 * 1e-4)
    slow = Placement(workers_per_node=2, inter_node_gbps=0.1)
    plain = Candidate(2, 16, 2, "fsdp", "every_micro_step")  # the same data-parallel work
    for placement in (Placement(), slow):
        with_tp = predict(tp, p, tensor_plan=plan, placement=placement).comm_s
        assert with_tp > tp_comm
    assert predict(tp, p, tensor_plan=plan).comm_s - tp_comm < predict(plain, p).comm_s
    with pytest.raises(ValueError, match="needs the model's TensorPlan"):
        predict(tp, p)


def test_the_tensor_plan_of_the_gpt_and_the_sizes_it_takes(tmp_path):
    from rayacc.models.registry import build_on_meta
    from rayacc.planner.search import tensor_parallel_options, tensor_plan
    from tests.support.data.tokens import token_data

    info = token_data(tmp_path, "ids")
    gpt = {"name": "gpt", "n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 8}
    cfg = TrainConfig.from_dict(
        {
            "model": gpt,
            "data": {"source": info.path, "seq_len": 8},
            "batch": {"global_batch_size": 8},
        }
    )
    model = build_on_meta(cfg, info)
    plan = tensor_plan(model, tokens=8, value_bytes=4)
    total = sum(p.numel() for p in model.parameters())
    # q, k, v and the MLP's 4× layer by columns, the projections back by rows: 12 h² + 9 h a
    # block, and 4 all-reduces of width h
    h = 32
    assert plan.split == pytest.approx(2 * (12 * h * h + 9 * h) / total)
    assert (plan.allreduces, plan.bytes_per_sample) == (8, 8 * 2 * 4 * h * 4)
    assert tensor_parallel_options(model, 8) == [2, 4]  # 8 does not divide 4 heads
    two_heads = cfg.model_copy(update={"model": cfg.model.model_copy(update={"n_head": 2})})
    assert tensor_parallel_options(build_on_meta(two_heads, info), 8) == [2]
    mlp = TrainConfig.from_dict({"batch": {"global_batch_size": 8}})
    from rayacc.data.bundled import prepare_bundled
    from rayacc.data.sources import describe_dataset

    digits = describe_dataset(str(prepare_bundled("digits")))
    assert tensor_plan(build_on_meta(mlp, digits), 1, 4) is None
