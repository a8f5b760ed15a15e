"""Where a run is recorded: the config's fields where set, else MLflow's own variables, else
rayacc's defaults; the header says which chose each."""

from __future__ import annotations

import pytest

from rayacc.tracking import tracking_target


@pytest.fixture
def no_mlflow_env(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    return monkeypatch


def test_the_defaults_where_nothing_says(no_mlflow_env, tmp_path):
    no_mlflow_env.chdir(tmp_path)
    t = tracking_target(None, None)
    assert (t.uri, t.experiment) == (f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}", "rayacc")
    assert (t.uri_from, t.experiment_from) == ("default", "default")


def test_mlflows_variables_where_the_config_is_null(no_mlflow_env):
    no_mlflow_env.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    no_mlflow_env.setenv("MLFLOW_EXPERIMENT_NAME", "team-runs")
    t = tracking_target(None, None)
    assert (t.uri, t.experiment) == ("http://mlflow.internal:5000", "team-runs")
    assert "(MLFLOW_TRACKING_URI)" in t.describe() and "(MLFLOW_EXPERIMENT_NAME)" in t.describe()


def test_the_config_wins_where_set(no_mlflow_env):
    no_mlflow_env.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    no_mlflow_env.setenv("MLFLOW_EXPERIMENT_NAME", "team-runs")
    t = tracking_target("sqlite:////tmp/x.db", "mine")
    assert (t.uri, t.experiment) == ("sqlite:////tmp/x.db", "mine")
    assert (t.uri_from, t.experiment_from) == ("tracking.tracking_uri", "tracking.experiment")


def test_a_training_experiment_opens_in_mlflows_model_training_view(tmp_path):
    from mlflow.tracking import MlflowClient

    from rayacc.tracking import MlflowSink

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sink = MlflowSink(uri, "fresh", "r")
    client = MlflowClient(uri)
    assert client.get_experiment(sink.experiment_id).tags["mlflow.experimentKind"] == (
        "custom_model_development"
    )
    # a kind the user chose stays
    mine = client.create_experiment("mine", tags={"mlflow.experimentKind": "genai_development"})
    MlflowSink(uri, "mine", "r")
    assert client.get_experiment(mine).tags["mlflow.experimentKind"] == "genai_development"
    sink.finish()
