"""Sweeps, reports and verify on a real local Ray with a real MLflow store."""

from __future__ import annotations

import csv
import itertools
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from rayacc import TrainConfig
from rayacc.config import SweepConfig
from rayacc.driver.sweep import run_sweep
from rayacc.driver.verify import verify
from rayacc.tracking.report import build_report, table_rows, write_report
from tests.support.services.fits import digits_subset

pytestmark = pytest.mark.ray
ROOT = Path(__file__).resolve().parents[2]


def test_a_sweep_over_the_strategy_with_auto_micro_batch_then_report(ray_local, tmp_path):
    """One sweep, every claim of a sweep: `train.strategy` as an axis with `micro_batch_size:
    auto` (the search runs on the sharded model in the fsdp trial), the global batch held, a
    setting that cannot hold it skipped before anything runs; both trials' losses are the same
    step for step (FSDP's step is DDP's); the parent and child runs in MLflow; the report's
    table, plots, verdict and loss curves agree with MLflow and the console."""
    source = digits_subset(tmp_path / "d96.parquet", 96)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = {
        "name": "test-sweep",
        "config": {
            "model": {"name": "mlp", "hidden_sizes": [16]},
            "data": {"source": source, "val_fraction": 0.25},
            "batch": {"global_batch_size": 32, "micro_batch_size": "auto", "memory_budget_mb": 64},
            "optim": {"name": "adamw", "lr": 0.01},
            "train": {"max_steps": 3},
            "scaling": {"num_workers": 2, "cpus_per_worker": 0.5},
            "tracking": {"tracking_uri": uri, "experiment": "sweeps"},
            "run": {"storage_path": str(tmp_path / "runs")},
        },
        "hold": "global_batch_size",
        # 5 does not divide 16 rows per worker: skipped before anything runs
        "grid": {"train.strategy": ["ddp", "fsdp"], "batch.micro_batch_size": [5, "auto"]},
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    sweep, base, _ = SweepConfig.from_yaml(path)
    events: list[tuple[str, int]] = []
    printed_s: dict[str, float] = {}

    def on_event(kind, t, info):
        events.append((kind, t.index))
        if kind == "finished":
            printed_s[str(t.index)] = info["wall_time_s"]  # what the console prints

    result = run_sweep(sweep, base, path.read_text(), on_event)

    skipped = [t for t in result.trials if t.skip_reason]
    assert [t.settings["batch.micro_batch_size"] for t in skipped] == [5, 5]
    assert all("batch.micro_batch_size" in t.skip_reason for t in skipped)
    assert sorted(i for kind, i in events if kind == "skipped") == [t.index for t in skipped]
    ran = sorted(t.index for t in result.trials if not t.skip_reason)
    assert sorted(i for kind, i in events if kind == "finished") == ran and len(ran) == 2

    client = MlflowClient(uri)
    parent = client.get_run(result.parent_run_id)
    assert parent.data.tags["rayacc.sweep"] == "true" and parent.data.tags["rayacc.skipped"] == "2"
    artifacts = {a.path for a in client.list_artifacts(result.parent_run_id)}
    assert {"sweep.yaml", "skipped.txt"} <= artifacts
    children = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{result.parent_run_id}'",
    )
    assert len(children) == 2
    # children named by what they try; the parent holds the sweep's settings and its best
    assert sorted(c.info.run_name for c in children) == [
        "batch.micro_batch_size=auto, train.strategy=ddp",
        "batch.micro_batch_size=auto, train.strategy=fsdp",
    ]
    assert parent.data.params["grid.train.strategy"] == "['ddp', 'fsdp']"
    assert parent.data.params["hold"] == "global_batch_size" and parent.data.params["trials"] == "2"
    best_loss = min(c.data.metrics["val/loss"] for c in children)
    assert parent.data.metrics["best/val_loss"] == pytest.approx(best_loss)
    assert parent.data.tags["rayacc.best_trial"] in {c.info.run_name for c in children}
    # the search picks 16 per worker (the whole of each rank's share) under the held batch
    resolved = {
        c.data.params["train.strategy"]: (
            int(c.data.params["micro_batch_size"]),
            int(c.data.params["grad_accum_steps"]),
        )
        for c in children
    }
    assert resolved == {"ddp": (16, 1), "fsdp": (16, 1)}, resolved
    assert {int(c.data.params["global_batch_size"]) for c in children} == {32}
    losses = {}
    for child in children:
        history = client.get_metric_history(child.info.run_id, "train/loss")
        losses[child.data.params["train.strategy"]] = [
            m.value for m in sorted(history, key=lambda m: m.step)
        ]
        micro = client.get_metric_history(child.info.run_id, "scaling/micro_batch_size")
        assert micro and all(m.value >= 1 for m in micro)
    assert len(losses["ddp"]) == 3
    for a, b in zip(losses["ddp"], losses["fsdp"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), losses

    report = build_report(uri, "sweeps")  # the experiment's latest sweep
    assert report.parent_run_id == result.parent_run_id
    # one measure of a trial's time on the console and in the table
    assert {r.trial: r.wall_time_s for r in report.rows} == pytest.approx(printed_s, abs=1e-3)
    # the common result, reached by every trial at one global batch
    assert report.verdict()[0].startswith("same final loss")
    assert all(r.time_to_target_s > 0 for r in report.rows)
    files = write_report(report, tmp_path / "report", tracking_uri=uri)
    with open(files[0]) as f:
        rows = list(csv.DictReader(f))
    assert sorted(int(r["micro"]) for r in rows) == [16, 16]
    for png in files[1:]:
        assert png.stat().st_size > 5000 and png.read_bytes()[:4] == b"\x89PNG"
    for child in children:
        label = next(
            k
            for k in report.loss_curves
            if k.startswith(f"trial {child.data.tags['rayacc.trial']}:")
        )
        seen, curve = report.loss_curves[label]
        history = sorted(
            client.get_metric_history(child.info.run_id, "train/loss"), key=lambda m: m.step
        )
        assert curve == [m.value for m in history]
        samples = sorted(
            client.get_metric_history(child.info.run_id, "train/samples"), key=lambda m: m.step
        )
        # samples seen: 32 a step, then the epoch's short last window (72 rows: 32 + 32 + 8)
        assert seen == list(itertools.accumulate(m.value for m in samples)) == [32.0, 64.0, 72.0]
    throughput = report.per_micro("samples_per_s")["2 worker(s)"]
    assert sorted(throughput[0]) == [16, 16]
    assert {"report/report.csv", "report/loss_vs_samples.png"} <= {
        a.path for a in client.list_artifacts(result.parent_run_id, "report")
    }


def stand_in_base(tmp_path: Path, uri: str) -> dict:
    """The base config of a sweep of `stand_in` trials (checked as any base; never trained)."""
    return {
        "batch": {"global_batch_size": 8, "micro_batch_size": 4},
        "scaling": {"num_workers": 1},
        "tracking": {"tracking_uri": uri, "experiment": "sweeps"},
        "run": {"storage_path": str(tmp_path / "runs")},
    }


def stand_in(uri: str, steps: int = 8):
    """A fit for the Tune tests: 8 steps of a loss that falls faster with the LR, logged
    through the sink and handed to the observers as a fit does, at a pace the scheduler's stop
    can reach between steps (a group start per trial is the suite's cost)."""

    def stand_in_fit(cfg, parent_run_id, tags, observers):
        import time
        from types import SimpleNamespace

        from rayacc.tracking import MlflowSink

        sink = MlflowSink(uri, "sweeps", cfg.tracking.run_name, parent_run_id=parent_run_id)
        sink.set_tags(tags)
        history = []
        for step in range(1, steps + 1):
            record = {"step": step, "train/loss": 2.0 / (1 + cfg.optim.lr * 100 * step)}
            sink.log_step_metrics([record])
            history.append(record)
            for observer in observers:
                observer.on_step(record)
            time.sleep(0.3)
        sink.finish()
        return SimpleNamespace(
            mlflow_run_id=sink.run_id, metrics=record, summary={}, wall_time_s=1.0,
            history=history,
        )  # fmt: skip

    return stand_in_fit


def test_a_scheduler_stops_the_worse_trial_marks_its_run_and_the_report_names_it(
    ray_local, tmp_path
):
    """Ray Tune's ASHA judges each step a trial reports and stops the worse one: its process
    (and so its nested group) ends, its MLflow run is ended KILLED and tagged, the sweep exits
    as done and its report says which trial stopped where. The trials run a stand-in fit that
    logs through the same sink and observers (`stand_in`)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = {
        "name": "asha-sweep",
        "config": stand_in_base(tmp_path, uri),
        "grid": {"optim.lr": [0.01, 0.0001]},  # the second learns slower: stopped at step 2
        "max_concurrent_trials": 1,  # the first sets every rung's bar
        "scheduler": {"name": "asha", "grace_period": 2, "reduction_factor": 2},
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    sweep, base, _ = SweepConfig.from_yaml(path)

    stand_in_fit = stand_in(uri)

    events = []
    result = run_sweep(
        sweep, base, path.read_text(), lambda kind, t, info: events.append((kind, t.index, info)),
        trial_fit=stand_in_fit,
    )  # fmt: skip
    assert [(k, i) for k, i, _ in events] == [
        ("started", 0), ("finished", 0), ("started", 1), ("stopped", 1)
    ], events  # fmt: skip
    why = result.outcomes[1]["stopped_early"]
    assert why.startswith("at step 2 by asha (train/loss "), why
    client = MlflowClient(uri)
    parent = client.get_run(result.parent_run_id)
    assert parent.data.tags["rayacc.stopped_trials"] == "1"
    assert parent.data.params["scheduler"] == "asha"
    assert parent.data.tags["rayacc.failed_trials"] == "none"
    children = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
    )
    by_trial = {c.data.tags["rayacc.trial"]: c for c in children}
    assert by_trial["0"].info.status == "FINISHED"
    stopped = by_trial["1"]
    assert stopped.info.status == "KILLED" and stopped.data.tags["rayacc.stopped_early"] == why
    # its process ended with the stop: no step long after it
    steps = [m.step for m in client.get_metric_history(stopped.info.run_id, "train/loss")]
    assert 2 <= max(steps) <= 4, steps
    report = build_report(uri, result.parent_run_id)
    assert report.verdict()[0].startswith("one trial finished: trial 0 (")
    assert f"trial 1 stopped early {why}" in report.verdict(), report.verdict()
    assert [r["trial"] for r in table_rows(report)] == ["0", "1 (stopped at step 2)"]


def test_a_search_algorithm_proposes_each_trial_and_each_is_a_run_of_what_it_tried(
    ray_local, tmp_path, capfd
):
    """Optuna (through Tune's OptunaSearch) proposes `random.samples` trials from
    `random.space`, each checked as a listed trial is, each a nested MLflow run named by what
    it tried, with the final metric the search learns from; a proposal the config refuses is
    a failed trial, named."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    spec = {
        "name": "optuna-sweep",
        "config": stand_in_base(tmp_path, uri),
        "random": {
            "samples": 4,
            "seed": 3,
            # 3 does not divide the global batch of 8: a proposal the rules refuse
            "space": {
                "optim.lr": {"loguniform": [0.0001, 0.1]},
                "batch.micro_batch_size": {"choice": [4, 3]},
            },
        },
        "search": "optuna",
        "max_concurrent_trials": 1,
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    sweep, base, _ = SweepConfig.from_yaml(path)
    events = []
    result = run_sweep(
        sweep, base, path.read_text(), lambda kind, t, info: events.append((kind, t, info)),
        trial_fit=stand_in(uri, steps=2),
    )  # fmt: skip
    # Optuna's own study lines are not rayacc's console
    assert "A new study created" not in capfd.readouterr().err
    ended = {t.index: (kind, t.settings) for kind, t, _ in events if kind != "started"}
    assert sorted(ended) == [0, 1, 2, 3], events
    for kind, settings in ended.values():
        assert set(settings) == {"optim.lr", "batch.micro_batch_size"}
        assert 0.0001 <= settings["optim.lr"] <= 0.1
        assert kind == ("failed" if settings["batch.micro_batch_size"] == 3 else "finished")
    for index, (kind, _) in ended.items():
        if kind == "failed":
            assert "batch.micro_batch_size" in result.outcomes[index]["error"]
    client = MlflowClient(uri)
    children = client.search_runs(
        [client.get_experiment_by_name("sweeps").experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{result.parent_run_id}'",
    )
    parent = client.get_run(result.parent_run_id).data
    assert parent.params["search"] == "optuna" and parent.params["trials"] == "4"
    assert parent.tags["rayacc.trials"] == "4"
    ran = {int(c.data.tags["rayacc.trial"]): c for c in children}
    assert sorted(ran) == sorted(i for i, (kind, _) in ended.items() if kind == "finished")
    for index, child in ran.items():
        lr = ended[index][1]["optim.lr"]
        # named in the order of the file's space
        assert child.info.run_name == f"batch.micro_batch_size=4, optim.lr={lr}"
        assert child.data.metrics["train/loss"] == pytest.approx(2.0 / (1 + lr * 200))


def test_a_search_algorithm_whose_package_is_absent_is_named_with_its_install(tmp_path):
    import importlib.util

    from rayacc.config import ConfigError

    spec = {"config": {}, "search": "hyperopt", "random": {"samples": 2, "space": {
        "optim.lr": {"uniform": [0.001, 0.1]}}}}  # fmt: skip
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    if importlib.util.find_spec("hyperopt") is not None:
        pytest.skip("hyperopt is installed here")
    with pytest.raises(ConfigError) as err:
        SweepConfig.from_yaml(path)
    assert "search.name" in str(err.value) and "pip install hyperopt" in str(err.value)


@pytest.mark.parametrize(
    "strategy",
    [["model.dropout=0.2"], ["train.strategy=deepspeed", "deepspeed.stage=3"]],
    ids=["ddp-dropout", "deepspeed-zero3"],
)
def test_verify_passes_on_the_default_job(ray_local, tmp_path, strategy):
    """Under DDP with dropout (turned off for the comparison, and said), and under ZeRO-3,
    whose weights verify reads back from DeepSpeed's files."""
    cfg = TrainConfig.from_yaml(
        ROOT / "jobs" / "digits.yaml",
        overrides=[
            f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            f"run.storage_path={tmp_path / 'runs'}",
            "scaling.cpus_per_worker=0.5",
            *strategy,
        ],
    )
    result = verify(cfg)
    assert result.passed, result.worst
    assert result.worst.max_rel <= 1e-4
    dropped = "model.dropout 0.2 → 0 for the comparison"
    assert (dropped in result.warnings) == ("model.dropout=0.2" in strategy), result.warnings
    assert {d.name for d in result.diffs} >= {"net.0.weight", "net.4.bias"}
    tags = MlflowClient(result.tracking_uri).get_run(result.mlflow_run_id).data.tags
    assert tags["rayacc.verified"] == "PASS"
    # `rayacc runs` shows the probe as what it is, not as a finished training run
    from rayacc.driver.runs import list_runs

    assert [(r.status, r.kind) for r in list_runs(str(tmp_path / "runs"))] == [
        ("finished", "verify")
    ]


def test_verify_fails_on_batchnorm(ray_local, tmp_path):
    cfg = TrainConfig.from_yaml(
        ROOT / "jobs" / "digits.yaml",
        overrides=[
            "model.name=factory",
            "model.factory=tests.support.models.bn_model:build",
            f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            f"run.storage_path={tmp_path / 'runs'}",
            "scaling.cpus_per_worker=0.5",
        ],
    )
    result = verify(cfg)
    assert not result.passed
    assert result.worst.max_rel > 1e-2
    assert any("BatchNorm" in w and "GroupNorm or LayerNorm" in w for w in result.warnings)
    tags = MlflowClient(result.tracking_uri).get_run(result.mlflow_run_id).data.tags
    assert tags["rayacc.verified"] == "FAIL"
