"""`rayacc report RUN` for a run of this folder's `rayacc_runs` that was tracked in another
store (a cluster's MLflow): read there where that store can be read, else named with the flag
that reaches it — never the circle of "not in this store, see `rayacc runs`"."""

from __future__ import annotations

import json

from rayacc.cli import main


def _recorded_run(tmp_path):
    """A run `grown` whose info file names the store it was tracked in, and that store."""
    from mlflow.tracking import MlflowClient

    from rayacc.tracking.sqlite_store import prepare_sqlite_store

    store = tmp_path / "cluster" / "mlflow.db"
    store.parent.mkdir()
    uri = f"sqlite:///{store}"
    prepare_sqlite_store(uri)
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("elastic"), run_name="grown")
    client.set_tag(run.info.run_id, "rayacc.run_name", "grown")  # as a run tags itself
    client.log_metric(run.info.run_id, "train/loss", 2.0, step=1)
    client.set_terminated(run.info.run_id)
    folder = tmp_path / "here" / "rayacc_runs" / "grown"
    folder.mkdir(parents=True)
    info = {"tracking_uri": uri, "mlflow_run_id": run.info.run_id, "status": "finished"}
    (folder / "rayacc_run.json").write_text(json.dumps(info))
    return store


def test_a_run_recorded_in_another_store_is_read_there(tmp_path, monkeypatch, capsys):
    store = _recorded_run(tmp_path)
    monkeypatch.chdir(tmp_path / "here")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["report", "grown", "--out", str(tmp_path / "r")]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert f"run 'grown' was recorded in sqlite:///{store}: read there" in out, out


def test_a_store_that_is_gone_is_named_with_the_flag(tmp_path, monkeypatch, capsys):
    store = _recorded_run(tmp_path)
    store.unlink()
    monkeypatch.chdir(tmp_path / "here")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["report", "grown"]) == 2
    err = capsys.readouterr().err
    assert str(store) in err and "--tracking-uri" in err and "rayacc runs" not in err, err
    assert "Traceback" not in err
