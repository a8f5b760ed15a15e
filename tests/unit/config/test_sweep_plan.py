"""Expanding a sweep into trials (no Ray)."""

from pathlib import Path

import pytest

from rayacc.config import SweepConfig, TrainConfig
from rayacc.driver.sweep import expand_trials

ROOT = Path(__file__).resolve().parents[3]

BASE = TrainConfig.from_dict(
    {
        "batch": {"global_batch_size": 64, "micro_batch_size": 8},
        "scaling": {"num_workers": 2},
    }
).model_dump(mode="json")


def test_hold_global_batch_derives_accumulation_and_skips_invalid():
    sweep = SweepConfig.model_validate(
        {
            "grid": {"batch.micro_batch_size": [4, 5, 32, 64], "scaling.num_workers": [1, 2]},
        }
    )
    trials = expand_trials(sweep, BASE)
    assert len(trials) == 8
    valid = [t for t in trials if t.config]
    plans = {
        (
            t.config["scaling"]["num_workers"],
            t.config["batch"]["micro_batch_size"],
        ): TrainConfig.model_validate(t.config).batch_split()
        for t in valid
    }
    assert {p.global_batch_size for p in plans.values()} == {64}
    assert plans[(1, 4)].grad_accum_steps == 16 and plans[(2, 4)].grad_accum_steps == 8
    assert plans[(1, 64)].grad_accum_steps == 1
    skipped = {
        (t.settings["scaling.num_workers"], t.settings["batch.micro_batch_size"]): t.skip_reason
        for t in trials
        if t.skip_reason
    }
    assert set(skipped) == {(1, 5), (2, 5), (2, 64)}
    assert "batch.micro_batch_size" in skipped[(1, 5)] and "does not divide" in skipped[(1, 5)]
    assert "larger than one worker's share" in skipped[(2, 64)]


def test_without_hold_the_global_batch_follows_the_grid():
    sweep = SweepConfig.model_validate(
        {
            "hold": None,
            "grid": {"batch.global_batch_size": [32, 128]},
        }
    )
    trials = expand_trials(sweep, BASE)
    assert [
        TrainConfig.model_validate(t.config).batch_split().grad_accum_steps for t in trials
    ] == [
        2,
        8,
    ]


def test_random_samples_are_seeded():
    spec = {
        "grid": {},
        "random": {
            "samples": 3,
            "seed": 4,
            "space": {
                "optim.lr": {"loguniform": [1e-4, 1e-2]},
                "batch.micro_batch_size": {"choice": [4, 8]},
            },
        },
    }
    a = expand_trials(SweepConfig.model_validate(spec), BASE)
    b = expand_trials(SweepConfig.model_validate(spec), BASE)
    assert [t.settings for t in a] == [t.settings for t in b] and len(a) == 3
    assert all(1e-4 <= t.settings["optim.lr"] <= 1e-2 for t in a)


def test_trials_of_a_named_base_run_each_get_a_folder_of_their_own():
    named = TrainConfig.from_dict(
        {
            "batch": {"global_batch_size": 64, "micro_batch_size": 8},
            "run": {"name": "exp"},
        }
    ).model_dump(mode="json")
    sweep = SweepConfig.model_validate({"grid": {"batch.micro_batch_size": [4, 8, 16]}})
    names = [t.config["run"]["name"] for t in expand_trials(sweep, named)]
    assert names == ["exp-trial0", "exp-trial1", "exp-trial2"]


@pytest.mark.parametrize(
    ("section", "names"),
    [
        ({"grid": {"batch.micro_batchsize": [8]}}, ["grid.batch.micro_batchsize", "did you mean"]),
        ({"grid": {"optim.lr": [0.1, "fast"]}}, ["grid.optim.lr", "'fast'"]),
        ({"grid": {"optimizer.lr": [0.1]}}, ["grid.optimizer.lr", "unknown"]),
        ({"grid": {"batch.micro_batch_size": [-4]}}, ["grid.batch.micro_batch_size"]),
        ({"grid": {"train.precision": ["fp8"]}}, ["grid.train.precision", "'fp8'"]),
        (
            {"random": {"samples": 1, "space": {"train.precison": {"choice": ["fp32"]}}}},
            ["random.space.train.precison", "did you mean"],
        ),
        (
            {"random": {"samples": 1, "space": {"optim.lr": {"uniform": [0.1, "x"]}}}},
            ["random.space.optim.lr", "'x'"],
        ),
        (
            {"random": {"samples": 1, "space": {"optim.lr": {"normal": [0, 1]}}}},
            ["random.space.optim.lr", "one distribution"],
        ),
        (
            {"random": {"samples": 1, "space": {"optim.lr": {"uniform": [0.1]}}}},
            ["random.space.optim.lr", "[low, high]"],
        ),
        ({"scheduler": "hyperopt"}, ["scheduler.name", "'asha'"]),
        (
            {"scheduler": {"name": "asha", "metric": "train/los"}},
            ["scheduler.metric", "train/loss"],
        ),
        (
            {"scheduler": {"name": "median_stopping", "reduction_factor": 3}},
            ["scheduler.reduction_factor", "asha"],
        ),
        ({"scheduler": {"name": "asha", "grace_period": 0}}, ["scheduler.grace_period"]),
    ],
)
def test_every_key_and_value_a_sweep_names_is_checked_before_any_trial(tmp_path, section, names):
    import yaml

    from rayacc.config import ConfigError, SweepConfig

    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": str(ROOT / "jobs/digits.yaml"), **section}))
    with pytest.raises(ConfigError) as err:
        SweepConfig.from_yaml(path)
    for name in names:
        assert name in str(err.value), (name, str(err.value))


def test_a_combination_that_fails_a_rule_across_fields_is_a_skipped_trial_not_an_error(tmp_path):
    import yaml

    from rayacc.config import SweepConfig

    path = tmp_path / "sweep.yaml"
    grid = {"batch.micro_batch_size": [8, 48]}  # 48 divides no share of 256 on 2 workers
    path.write_text(yaml.safe_dump({"base": str(ROOT / "jobs/digits.yaml"), "grid": grid}))
    sweep, base, _ = SweepConfig.from_yaml(path)
    trials = expand_trials(sweep, base)
    assert [t.skip_reason is None for t in trials] == [True, False]


def test_the_best_trial_is_the_lowest_final_validation_loss_of_those_that_finished():
    from rayacc.driver.sweep import best_trial

    outcomes = {
        0: {"ok": True, "metrics": {"val/loss": 0.5, "train/loss": 0.1}},
        1: {"ok": True, "metrics": {"val/loss": 0.3, "train/loss": 0.4}},
        2: {"ok": False, "error": "out of memory"},
    }
    assert best_trial(outcomes) == (1, "val_loss", 0.3)
    # no validation: by the training loss
    assert best_trial({0: {"ok": True, "metrics": {"train/loss": 0.2}}}) == (0, "train_loss", 0.2)
    assert best_trial({2: outcomes[2]}) is None


@pytest.mark.parametrize(
    ("given", "judged"),
    [
        ("asha", ("train/loss", "min")),
        ({"name": "asha", "metric": "val/accuracy"}, ("val/accuracy", "max")),
        (
            {"name": "median_stopping", "metric": "train/samples_per_s"},
            ("train/samples_per_s", "max"),
        ),
        ({"name": "asha", "metric": "val/accuracy", "mode": "min"}, ("val/accuracy", "min")),
    ],
)
def test_a_scheduler_by_name_judges_by_its_metric_in_the_direction_left_out(given, judged):
    from rayacc.driver.sweep_tune import scheduler_of

    sweep = SweepConfig.model_validate({"config": {}, "scheduler": given})
    assert sweep.scheduler.judged_as() == judged
    tune_scheduler = scheduler_of(sweep)
    # Tune's own object judges the same, by the optimizer step
    assert (tune_scheduler.metric, tune_scheduler._mode) == judged
    assert tune_scheduler._time_attr == "step"


def test_a_named_sweep_run_again_into_its_storage_is_refused_before_anything_runs(tmp_path, capsys):
    """A named base gives each trial a run of its own; run again, the sweep would start and
    every trial fail where it starts (exit 1 after the cluster's start): exit 2 at once."""
    import yaml

    from rayacc.cli import main

    storage = tmp_path / "runs"
    (storage / "fixed-trial1").mkdir(parents=True)  # the first sweep's second trial
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({
        "base": str(ROOT / "jobs/digits.yaml"),
        "overrides": ["run.name=fixed", f"run.storage_path={storage}"],
        "grid": {"batch.micro_batch_size": [16, 32]},
    }))  # fmt: skip
    assert main(["sweep", "-c", str(path)]) == 2
    err = capsys.readouterr().err
    assert "run.name='fixed'" in err and "fixed-trial1" in err and "Traceback" not in err, err
    assert "fixed-trial0" not in err  # only the runs that are there
