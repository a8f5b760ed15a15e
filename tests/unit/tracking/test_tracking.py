"""The MLflow sink against a real sqlite store."""

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from rayacc import TrainConfig
from rayacc.tracking import MlflowSink, contract_params


def records(steps):
    return [{"step": s, "train/loss": 1.0 / s, "train/items": 10} for s in steps]


def test_reopened_run_never_records_a_step_twice(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = MlflowSink(uri, "exp", "run")
    first.log_step_metrics(records([1, 2, 3]))
    first.log_step_metrics(records([3]))  # a replay inside one driver
    first.finish("FAILED")

    again = MlflowSink(uri, "exp", run_id=first.run_id)
    again.log_step_metrics(records([2, 3, 4, 5]))  # replay after a restart from step 1
    again.finish()

    client = MlflowClient(uri)
    for key in ("train/loss", "train/items"):
        steps = sorted(m.step for m in client.get_metric_history(first.run_id, key))
        assert steps == [1, 2, 3, 4, 5], key
    assert client.get_run(first.run_id).info.status == "FINISHED"


def test_contract_params_are_the_resolved_values(tmp_path):
    cfg = TrainConfig.from_dict(
        {
            "batch": {"global_batch_size": 256, "micro_batch_size": 16},
            "scaling": {"num_workers": 4},
            "optim": {"lr": 0.01, "base_batch_size": 64, "lr_scaling": "sqrt"},
        }
    )
    params = contract_params(cfg, cfg.batch_split(), 0.02)
    assert params["grad_accum_steps"] == 4 and params["num_workers"] == 4
    assert params["global_batch_size"] == 256 and params["micro_batch_size"] == 16
    assert (params["base_lr"], params["base_batch_size"], params["lr_scaling"]) == (
        0.01,
        64,
        "sqrt",
    )
    assert params["effective_lr"] == 0.02


CONTRACT = ["micro_batch_size", "grad_accum_steps", "num_workers", "global_batch_size",
            "base_lr", "base_batch_size", "lr_scaling", "effective_lr"]  # fmt: skip
"""The contract's params, in its order (shared/design.md, "MLflow record of a training run")."""


@pytest.mark.parametrize(
    "batch",
    [
        {"global_batch_size": 64, "micro_batch_size": 8},
        {"global_batch_size": 64, "grad_accum_steps": 2},
        {"micro_batch_size": 8, "grad_accum_steps": 4},
        {"global_batch_size": 64, "micro_batch_size": "auto", "memory_budget_mb": 2048},
    ],
)
def test_the_contract_params_come_first_and_each_value_once(batch):
    """MLflow's run page lists params in the order they were logged: the contract's resolved
    values first, then the run's strategy and model, then the config; a config key whose
    value is a contract param is not recorded again under its own name."""
    from rayacc.tracking.params import CONTRACT_FIELDS, FIRST_KEYS, _applies

    cfg = TrainConfig.from_dict(
        {
            "batch": batch,
            "optim": {"lr": 0.01, "base_batch_size": 32},
            "train": {"strategy": "fsdp"},
        }
    )
    split = cfg.batch_split()
    params = contract_params(cfg, split, 0.02)
    keys = list(params)
    assert keys[: len(CONTRACT) + len(FIRST_KEYS)] == [*CONTRACT, *FIRST_KEYS], keys
    assert set(CONTRACT_FIELDS.values()) <= set(CONTRACT)
    auto = batch.get("micro_batch_size") == "auto"
    for key in CONTRACT_FIELDS:
        kept = key == "batch.micro_batch_size" and auto
        assert (key in params) == kept, (key, params.get(key))
    # every other key of the config that applies is there, once
    rest = [k for k in cfg.flat() if k not in CONTRACT_FIELDS and _applies(k, "fsdp", "mlp")]
    assert set(rest) <= set(keys) and len(keys) == len(set(keys))


@pytest.mark.parametrize(
    ("model", "strategy"),
    [("mlp", "ddp"), ("gpt", "fsdp"), ("hf", "deepspeed"), ("factory", "ddp")],
)
def test_only_the_sections_that_apply_to_the_run_are_recorded(model, strategy):
    from rayacc.tracking.params import MODEL_KEYS

    section = {
        "mlp": {},
        "gpt": {},
        "hf": {"hf": {"config": {"model_type": "llama"}}},
        "factory": {"factory": "m:f"},
    }[model]
    cfg = TrainConfig.from_dict(
        {
            "model": {"name": model, **section},
            "batch": {"global_batch_size": 32, "micro_batch_size": 4},
            "train": {"strategy": strategy},
        }
    )
    keys = set(contract_params(cfg, cfg.batch_split(), 0.1))
    # each key of the schema's model section is there exactly when its kind reads it
    for field in type(cfg.model).model_fields:
        if field == "name":
            continue
        recorded = any(k == f"model.{field}" or k.startswith(f"model.{field}.") for k in keys)
        assert recorded == (field in MODEL_KEYS[model]), (field, model)
    for other in ("fsdp", "deepspeed"):
        assert any(k.startswith(f"{other}.") for k in keys) == (other == strategy), other
    assert "model.name" in keys and "base_lr" in keys


def test_unreachable_server_disables_tracking_with_one_message(capsys):
    sink = MlflowSink("http://127.0.0.1:9", "exp", "run")
    sink.log_params({"a": 1})
    sink.log_step_metrics(records([1]))
    sink.finish()
    assert not sink.active and sink.run_id is None
    assert capsys.readouterr().err.count("tracking off, training goes on") == 1


def test_a_server_slow_to_answer_its_first_requests_keeps_the_record(
    mlflow_server, monkeypatch, capsys
):
    """A just-started server that does not answer the first requests within MLflow's read
    timeout turned tracking off for the whole run: a slow server is asked again (within
    `OPEN_WITHIN_S`); one that is not there is given up at once."""
    import time

    from tests.support.services.mlflow_server import Gate

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    gate = Gate(mlflow_server)
    gate.stall(2.0, 2.0)  # the health check, then the first call after it
    sink = MlflowSink(gate.uri, "slow-start", "run")
    sink.log_params({"a": 1})
    sink.finish()
    assert sink.active, capsys.readouterr().err
    assert "tracking off" not in capsys.readouterr().err
    assert MlflowClient(gate.uri).get_run(sink.run_id).data.params == {"a": "1"}
    start = time.monotonic()
    gone = MlflowSink("http://127.0.0.1:9", "exp", "run")  # nobody there: no waiting
    assert not gone.active and time.monotonic() - start < 5


def test_a_reopened_run_extends_its_event_tags(tmp_path):
    from rayacc.config.batch_split import BatchSplit
    from rayacc.observe.events import Resized, RunStarted
    from rayacc.tracking import RunIdentity, open_tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = TrainConfig.from_dict(
        {
            "batch": {"global_batch_size": 32, "micro_batch_size": 4},
            "tracking": {"tracking_uri": uri},
        }
    )

    def identity(previous=None):
        return RunIdentity(
            "run", str(tmp_path), BatchSplit(32, 4, 4, 2), 0.1, "layout", 10, previous
        )

    def resize(step, old, new):
        return Resized(
            step, "keep_global_batch", old, new, 32 // (4 * old), 32 // (4 * new), 32, 32, 0.1, 4
        )

    first = open_tracking(cfg, identity())
    first.on_event(resize(4, 2, 1))
    first.on_event(RunStarted(4, 10, 4, "layout", {}, 0.1))
    first.close("FAILED")
    # the next driver session reopens the run and sees one more resize and one more resume
    again = open_tracking(cfg, identity(first.run_id))
    again.on_event(resize(8, 1, 2))
    again.on_event(RunStarted(8, 10, 8, "layout", {}, 0.1))
    again.close("FINISHED")
    tags = MlflowClient(uri).get_run(first.run_id).data.tags
    assert tags["rayacc.resizes"] == (
        "step 4: workers 2→1, accum 4→8, global 32→32 (micro 4, effective LR 0.1); "
        "step 8: workers 1→2, accum 8→4, global 32→32 (micro 4, effective LR 0.1)"
    )
    assert tags["rayacc.resumed_at_steps"] == "4,8"


def test_the_run_info_keeps_the_mlflow_run_on_any_storage_and_never_loses_it(tmp_path):
    from rayacc.driver.runs import RunLocation, locate_run

    storage = f"file://{tmp_path / 'store'}"  # through pyarrow, as s3:// or gs:// would be
    cfg = TrainConfig.from_dict(
        {
            "batch": {"global_batch_size": 32, "micro_batch_size": 4},
            "run": {"storage_path": storage},
        }
    )
    job = {"seed": 0, "data.source": "digits"}
    first = locate_run(cfg.run, resume=False)
    first.record(mlflow_run_id="run-1", tracking_uri="http://mlflow:5000", identity=job)
    # the latest run of this job, read back from the URI
    resumed = locate_run(cfg.run, resume=True, identity=job)
    assert resumed.name == first.name and resumed.previous["mlflow_run_id"] == "run-1"
    resumed.record(mlflow_run_id=None, tracking_uri=None)  # tracking was away this attempt
    again = locate_run(cfg.run, resume=True, identity=job)
    assert again.previous["mlflow_run_id"] == "run-1"
    assert again.previous["tracking_uri"] == "http://mlflow:5000"
    assert isinstance(again, RunLocation)


def test_a_new_sqlite_store_is_a_copy_of_the_cached_empty_one(tmp_path, monkeypatch):
    """A new `mlflow.db` is copied from an empty store kept in the cache (MLflow's migrations
    run once per version, not per store) and is what MLflow itself would have created: the
    same schema version and default experiment, whose artifact location follows the working
    folder; an existing store is never replaced."""
    import sqlite3

    from mlflow.tracking import MlflowClient

    from rayacc.tracking.sqlite_store import prepare_sqlite_store

    monkeypatch.setenv("RAYACC_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    native, copied = tmp_path / "native.db", tmp_path / "copied.db"
    MlflowClient(f"sqlite:///{native}").search_experiments()
    assert prepare_sqlite_store(f"sqlite:///{copied}")
    assert list((tmp_path / "cache" / "mlflow").glob("empty-*.db"))

    def contents(db):
        with sqlite3.connect(db) as conn:
            version = conn.execute("SELECT version_num FROM alembic_version").fetchall()
            tables = conn.execute("SELECT name FROM sqlite_master ORDER BY name").fetchall()
            exps = conn.execute("SELECT experiment_id, name, artifact_location FROM experiments")
            return version, tables, exps.fetchall()

    assert contents(copied) == contents(native)
    client = MlflowClient(f"sqlite:///{copied}")
    run = client.create_run(client.create_experiment("e"))
    client.log_metric(run.info.run_id, "loss", 1.0, step=1)
    assert client.get_run(run.info.run_id).data.metrics == {"loss": 1.0}
    before = copied.read_bytes()
    assert not prepare_sqlite_store(f"sqlite:///{copied}")
    assert copied.read_bytes() == before


@pytest.mark.parametrize(
    ("recorded", "now", "reopens", "continues"),
    [
        # the same store (as the run's folder keeps it, masked): the run is reopened
        (
            {"mlflow_run_id": "r1", "tracking_uri": "sqlite:////a/mlflow.db"},
            "sqlite:////a/mlflow.db",
            "r1",
            "",
        ),
        (
            {"mlflow_run_id": "r1", "tracking_uri": "http://***@h:5000"},
            "http://u:pw@h:5000",
            "r1",
            "",
        ),
        # another store: a new run there, tagged with the one it continues
        (
            {"mlflow_run_id": "r1", "tracking_uri": "sqlite:////a/mlflow.db"},
            "sqlite:////b/mlflow.db",
            None,
            "r1 of sqlite:////a/mlflow.db",
        ),
        (
            {"mlflow_run_id": "r1", "tracking_uri": "sqlite:////a/mlflow.db"},
            "http://h:5000",
            None,
            "r1 of sqlite:////a/mlflow.db",
        ),
        # nothing recorded (a fresh run, or tracking was off): nothing to reopen
        ({}, "sqlite:////a/mlflow.db", None, ""),
        ({"mlflow_run_id": "r1"}, "sqlite:////b/mlflow.db", "r1", ""),
    ],
)
def test_a_resume_into_another_store_starts_a_run_there_that_says_what_it_continues(
    recorded, now, reopens, continues
):
    from rayacc.driver.resume import continued_run

    assert continued_run(recorded, now) == (reopens, continues)


def test_a_steps_metrics_carry_the_time_the_step_ended_and_that_time_is_no_metric(tmp_path):
    """Records reach the driver in bursts: MLflow's timestamp of a step is the rank's."""
    from rayacc.observe.ranks import TIME_KEY

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sink = MlflowSink(uri, "exp", "run")
    ended = [1_700_000_000.25, 1_700_000_003.5]
    sink.log_step_metrics([{**r, TIME_KEY: t} for r, t in zip(records([1, 2]), ended)])
    sink.finish()
    client = MlflowClient(uri)
    history = client.get_metric_history(sink.run_id, "train/loss")
    assert sorted((m.step, m.timestamp) for m in history) == [(1, 1_700_000_000_250),
                                                              (2, 1_700_000_003_500)]  # fmt: skip
    assert TIME_KEY not in client.get_run(sink.run_id).data.metrics


def test_the_deepspeed_config_a_run_uses_is_an_artifact_and_the_description_its_batch(tmp_path):
    """The user's file merged under the job's keys, as DeepSpeed gets it ("auto" filled in):
    the file as the driver read it for the workers, not as it is when the record is written; a
    strategy with no configuration of its own writes none. The run's MLflow description is its
    batch arithmetic."""
    import json

    from rayacc.config.batch_split import BatchSplit
    from rayacc.data.sources import DatasetInfo
    from rayacc.driver.prelaunch import prepare
    from rayacc.tracking import RunIdentity, open_tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    user = tmp_path / "ds.json"
    zero = {"stage": 2, "reduce_bucket_size": 7000}
    read = {"train_batch_size": "auto", "zero_optimization": zero}
    for strategy, extra in (("deepspeed", {"deepspeed": {"stage": 2, "config": str(user)}}),
                            ("ddp", {})):  # fmt: skip
        cfg = TrainConfig.from_dict(
            {
                "batch": {"global_batch_size": 32, "micro_batch_size": 4},
                "train": {"strategy": strategy},
                "tracking": {"tracking_uri": uri},
                **extra,
            }
        )
        data = DatasetInfo(str(tmp_path / "digits.parquet"), "classification", 1797,
                           fingerprint="0123456789abcdef")  # fmt: skip
        # the driver reads the user's file once, deriving the run; the file changes after
        user.write_text(json.dumps(read))
        spec = prepare(cfg).spec
        later = {**read, "zero_optimization": {**zero, "reduce_bucket_size": 9}}
        user.write_text(json.dumps(later))
        identity = RunIdentity(
            strategy, str(tmp_path), BatchSplit(32, 4, 4, 2), 0.1, "l", 10, data=data,
            train_rows=1527, record_files=spec.record_files, lr_explanation=spec.lr_explanation,
        )  # fmt: skip
        tracked = open_tracking(cfg, identity)
        checkpoint = str(tmp_path / "runs" / strategy / "checkpoint_step00000003")
        history = [{"step": s, "train/loss": 1.0 / s} for s in (1, 2, 3)]
        tracked.close("FINISHED", history=history, checkpoint_dir=checkpoint, model="mlp")
        client = MlflowClient(uri)
        # the final model: a logged model of the run, its output at the last step, the
        # checkpoint its weights
        run = client.get_run(tracked.run_id)
        (output,) = run.outputs.model_outputs
        model = client.get_logged_model(output.model_id)
        assert (output.step, model.name, model.source_run_id) == (3, "mlp-step3", tracked.run_id)
        assert model.tags["rayacc.checkpoint"] == checkpoint and str(model.status) == "READY"
        # MLflow's description of the run: its batch arithmetic
        note = client.get_run(tracked.run_id).data.tags["mlflow.note.content"]
        assert note == (
            "global batch 32 = micro 4 × accum 4 × workers 2; "
            "effective LR 0.001 = 0.001 × linear(32/32)"
        )
        # the data as MLflow's dataset input of the run (`log_input`)
        (given,) = client.get_run(tracked.run_id).inputs.dataset_inputs
        assert (given.dataset.digest, given.tags[0].value) == ("0123456789abcdef", "training")
        assert json.loads(given.dataset.profile) == {
            "num_rows": 1797, "train_rows": 1527, "format": "classification"
        }  # fmt: skip
        assert json.loads(given.dataset.source) == {"uri": str(tmp_path / "digits.parquet")}
        names = {a.path for a in client.list_artifacts(tracked.run_id)}
        assert ("deepspeed_config.json" in names) == (strategy == "deepspeed"), names
        if strategy == "deepspeed":
            path = client.download_artifacts(tracked.run_id, "deepspeed_config.json", str(tmp_path))
            merged = json.loads(Path(path).read_text())
            assert merged["train_batch_size"] == 32 and merged["zero_optimization"]["stage"] == 2
            assert merged["zero_optimization"]["reduce_bucket_size"] == 7000


def test_a_logged_model_retried_after_the_server_made_it_is_one_model(tmp_path, capsys):
    """The server made the run's logged model and then went away before the rest of the call
    (its finalisation): the retry finishes that model instead of making a second."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sink = MlflowSink(uri, "exp", "run")
    sink.RETRY_INTERVAL_S = 0.05
    finalize, failed = sink.client.finalize_logged_model, []

    def away_once(*args, **kwargs):
        if not failed:
            failed.append(True)
            raise ConnectionError("connection reset by peer")
        return finalize(*args, **kwargs)

    sink.client.finalize_logged_model = away_once
    sink.log_model_of("mlp-step3", 3, str(tmp_path / "checkpoint_step00000003"), "mlp")
    sink.finish()
    client = MlflowClient(uri)
    run = client.get_run(sink.run_id)
    models = client.search_logged_models([run.info.experiment_id])
    assert failed and [(m.name, str(m.status)) for m in models] == [("mlp-step3", "READY")]
    assert [(o.model_id, o.step) for o in run.outputs.model_outputs] == [(models[0].model_id, 3)]
    assert "unreachable" in capsys.readouterr().err


def test_the_logged_model_loads_with_mlflows_own_loader(tmp_path, capsys, monkeypatch):
    """MLflow's `mlflow.pytorch.load_model` of the run's logged model gives the checkpoint's
    model (its outputs equal); where the weights cannot be read, no logged model — one line
    says why — rather than one MLflow's loaders fail on."""
    import mlflow.pytorch
    import torch

    monkeypatch.chdir(tmp_path)  # a sqlite store's artifacts go under the working folder
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sink = MlflowSink(uri, "exp", "run")
    torch.manual_seed(0)
    final = torch.nn.Linear(4, 3)
    sink.log_model_of("mlp-step3", 3, str(tmp_path / "ckpt"), "mlp", lambda: final)

    def unreadable():
        raise FileNotFoundError("checkpoint_step00000004/model.pt")

    sink.log_model_of("mlp-step4", 4, str(tmp_path / "ckpt4"), "mlp", unreadable)
    sink.finish()
    client = MlflowClient(uri)
    run = client.get_run(sink.run_id)
    (model,) = client.search_logged_models([run.info.experiment_id])
    assert model.name == "mlp-step3" and model.tags["rayacc.checkpoint"] == str(tmp_path / "ckpt")
    x = torch.randn(5, 4)
    with mlflow.tracking._tracking_service.utils._use_tracking_uri(uri):
        loaded = mlflow.pytorch.load_model(f"models:/{model.model_id}")
    assert torch.equal(loaded(x), final(x))
    err = capsys.readouterr().err
    assert "no MLflow logged model mlp-step4: its weights could not be saved" in err, err
    assert "FileNotFoundError" in err and not list(tmp_path.glob("rayacc-mlflow-model-*"))


def test_a_restarted_attempt_stays_one_run_whose_lineage_passes_over_the_discarded_steps(
    tmp_path,
):
    from rayacc.config.batch_split import BatchSplit
    from rayacc.observe.events import RunStarted
    from rayacc.observe.ranks import TIME_KEY
    from rayacc.tracking import RunIdentity, open_tracking
    from rayacc.tracking.history import DISCARDED_TAG, lineage_points

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = TrainConfig.from_dict(
        {
            "batch": {"global_batch_size": 32, "micro_batch_size": 4},
            "tracking": {"tracking_uri": uri},
        }
    )
    t0 = 1_765_000_000.0
    clock = iter(t0 + 0.25 * k for k in range(1, 100))

    def rec(step, loss, **extra):
        return {"step": step, "train/loss": loss, TIME_KEY: next(clock), **extra}

    lineage = {s: rec(s, 1.0 / s) for s in range(1, 4)}  # the checkpoint at step 3 holds these

    def identity(previous=None):
        return RunIdentity(
            "run", str(tmp_path), BatchSplit(32, 4, 4, 2), 0.1, "layout", 10, previous
        )

    def started(step):
        return RunStarted(step, 9, step or None, "layout", {}, 0.1, announced_at=next(clock))

    def lineage_of(step):
        return [lineage[s] for s in range(1, step + 1)]

    first = open_tracking(cfg, identity(), lineage=lineage_of)
    first.on_event(started(0))
    for s in range(1, 4):
        first.on_step(lineage[s])
    # an attempt that reaches no checkpoint: steps 4 and 5, a third rank's figure
    for s in (4, 5):
        first.on_step(rec(s, 9.0, **{"rank_2/own_s": 1.0}))
    first.on_event(started(3))  # the next group starts again from the checkpoint at step 3
    for s in (4, 5, 6):
        first.on_step(rec(s, 1.0 / s))
    first.close("FAILED")
    # the next driver session: its group starts from the checkpoint at step 3 once more
    again = open_tracking(cfg, identity(first.run_id), lineage=lineage_of)
    again.on_event(started(3))
    for s in range(4, 10):
        again.on_step(rec(s, 1.0 / s))
    again.close("FINISHED")

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rayacc").experiment_id])
    assert run.info.run_id == first.run_id and run.info.status == "FINISHED"
    marks = run.data.tags[DISCARDED_TAG].split("; ")
    assert [m.split(" logged")[0] for m in marks] == ["steps 4-5", "steps 4-6"]
    raw = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss"))
    assert raw == [1, 2, 3, 4, 4, 4, 5, 5, 5, 6, 6, 7, 8, 9]  # every point kept, none deleted
    held = [(m.step, m.value) for m in lineage_points(client, run, "train/loss")]
    assert held == [(s, 1.0 / s) for s in range(1, 10)]
    assert lineage_points(client, run, "rank_2/own_s") == []


@pytest.mark.parametrize("ms", [0, 1, 999, 1_765_000_000_123, 1_765_000_000_999])
def test_a_discarded_mark_reads_back_as_written_and_a_long_tag_keeps_whole_marks(ms):
    from rayacc.tracking.history import Discarded, discarded_marks, marks_tag

    marks = [Discarded(4 + k, 9 + k, ms + k) for k in range(400)]
    tag = marks_tag(marks)
    assert len(tag) <= 7000
    kept = discarded_marks({"rayacc.discarded_steps": tag})
    assert kept == marks[-len(kept) :] and len(kept) > 100


def test_the_runs_history_is_read_through_the_lineage_only():
    """A reader of a run's metrics that did not pass over the discarded points would report an
    attempt no checkpoint kept."""
    import rayacc

    root = Path(rayacc.__file__).parent
    readers = {
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if "get_metric_history" in p.read_text()
    }
    # the sink reads which (key, step) a reopened run holds; history.py is the lineage's reader
    assert readers == {"tracking/history.py", "tracking/mlflow_sink.py"}, readers


def test_each_experiment_gets_the_saved_view_once_and_a_changed_one_stays(tmp_path):
    import json

    from rayacc.tracking.ui_view import LEADING_SECTIONS, VIEW_TAG

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    mine = client.create_experiment("mine")  # made outside rayacc: the view is added
    first = MlflowSink(uri, "mine", "run")
    view = json.loads(client.get_experiment(mine).tags[VIEW_TAG])
    state = json.loads(view["state"])
    assert [s["name"] for s in state["compareRunSections"]] == list(LEADING_SECTIONS)
    assert "params.`global_batch_size`" in state["selectedColumns"]
    first.finish()
    client.set_experiment_tag(mine, VIEW_TAG, "changed in the UI")
    MlflowSink(uri, "mine", "again").finish()
    assert client.get_experiment(mine).tags[VIEW_TAG] == "changed in the UI"


@pytest.mark.parametrize(
    ("exit_", "status"),
    [
        ("a user's mistake a worker found (rc 2)", "FAILED"),
        ("a training error (rc 1)", "FAILED"),
        ("a worker's crash (rc 1)", "FAILED"),
        ("Ctrl-C (rc 130)", "KILLED"),
        ("the process told to exit", "KILLED"),
    ],
)
def test_every_exit_after_the_run_opens_ends_it_with_its_reason(tmp_path, exit_, status):
    """A run the workers failed in stayed RUNNING with no word of why: each exit ends it
    FAILED or KILLED, the reason a tag (masked as every tag), its status what `fit` records in
    the run's folder."""
    from rayacc.config.batch_split import BatchSplit
    from rayacc.driver.fit import TrainingError
    from rayacc.models import ModelError
    from rayacc.redact import MASK
    from rayacc.tracking import RunIdentity, open_tracking
    from rayacc.tracking.run import FAILURE_TAG

    secret = "ghp_" + "A1b2C3d4E5" * 4
    raised = {
        "a user's mistake a worker found (rc 2)": ModelError(
            f"train.loss='m:f' returned a tensor of shape (2,), token {secret}"),
        "a training error (rc 1)": TrainingError("the worker group failed 3 times"),
        "a worker's crash (rc 1)": RuntimeError("CUDA error: an illegal memory access"),
        "Ctrl-C (rc 130)": KeyboardInterrupt(),
        "the process told to exit": SystemExit(143),
    }[exit_]  # fmt: skip
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = TrainConfig.from_dict({"batch": {"global_batch_size": 32, "micro_batch_size": 4},
                                 "tracking": {"tracking_uri": uri}})  # fmt: skip
    identity = RunIdentity("run", str(tmp_path), BatchSplit(32, 4, 4, 2), 0.1, "layout", 10)
    tracked = open_tracking(cfg, identity)
    assert tracked.ended_by(raised) == status
    run = MlflowClient(uri).get_run(tracked.run_id)
    assert run.info.status == status
    reason = run.data.tags[FAILURE_TAG]
    assert reason.startswith(type(raised).__name__), reason
    assert secret not in reason and (MASK in reason) == (secret in str(raised)), reason
