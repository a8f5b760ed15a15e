"""The MLflow sink against a real sqlite store."""

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
    params = contract_params(cfg, cfg.batch_plan(), 0.02)
    assert params["grad_accum_steps"] == 4 and params["num_workers"] == 4
    assert params["global_batch_size"] == 256 and params["micro_batch_size"] == 16
    assert (params["base_lr"], params["base_batch_size"], params["lr_scaling"]) == (
        0.01,
        64,
        "sqrt",
    )
    assert params["effective_lr"] == 0.02
    assert (
        params["batch.grad_accum_steps"] is None
    )  # the config as given, beside the resolved value


def test_unreachable_server_disables_tracking_with_one_message(capsys):
    sink = MlflowSink("http://127.0.0.1:9", "exp", "run")
    sink.log_params({"a": 1})
    sink.log_step_metrics(records([1]))
    sink.finish()
    assert not sink.active and sink.run_id is None
    assert capsys.readouterr().err.count("tracking off, training goes on") == 1
