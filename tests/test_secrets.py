"""Nothing secret leaves the machine: credentials in URIs are masked in everything logged or
printed, and the upload and image filters keep secret files out."""

from __future__ import annotations

import subprocess
from pathlib import Path

from mlflow.tracking import MlflowClient

from rayacc.redact import redact
from rayacc.runner import jobs
from rayacc.tracking import MlflowSink

ROOT = Path(__file__).resolve().parent.parent
SECRET_URI = "http://alice:s3cr3t-pw@mlflow.internal:5000"


def test_credentials_in_uris_are_masked_wherever_they_stand():
    assert redact(SECRET_URI) == "http://***@mlflow.internal:5000"
    assert redact("https://ghp_TOKEN@host/x") == "https://***@host/x"
    assert redact("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"
    assert redact({"a": ["postgresql://u:p@db/m", 3]}) == {"a": ["postgresql://***@db/m", 3]}


def test_params_tags_and_texts_reach_mlflow_without_credentials(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sink = MlflowSink(uri, "exp", "run")
    sink.log_params({"tracking.tracking_uri": SECRET_URI, "lr": 0.1})
    sink.set_tags({"rayacc.storage_path": SECRET_URI})
    sink.log_text(f"tracking:\n  tracking_uri: {SECRET_URI}\n", "config.yaml")
    sink.finish()
    client = MlflowClient(uri)
    run = client.get_run(sink.run_id)
    text = Path(client.download_artifacts(sink.run_id, "config.yaml", str(tmp_path))).read_text()
    logged = [*run.data.params.values(), *run.data.tags.values(), text]
    assert not any("s3cr3t" in v or "alice" in v for v in logged), logged
    assert run.data.params["tracking.tracking_uri"] == "http://***@mlflow.internal:5000"


def test_an_unreachable_server_is_named_without_its_credentials(capsys):
    sink = MlflowSink("http://alice:s3cr3t-pw@127.0.0.1:9", "exp", "run")
    assert not sink.active
    err = capsys.readouterr().err
    assert "tracking off" in err and "127.0.0.1:9" in err
    assert "s3cr3t" not in err and "alice" not in err


def test_secret_files_stay_out_of_uploads_and_images(monkeypatch):
    monkeypatch.chdir(ROOT)
    secrets = [ROOT / ".env", ROOT / "jobs" / "gcp-credentials.json", ROOT / "deploy.pem"]
    for path in secrets:
        path.write_text("SECRET=1\n")
    try:
        uploaded = set(jobs.upload_files(ROOT))
        assert not uploaded & set(secrets), uploaded & set(secrets)
        ignored = subprocess.run(
            ["git", "check-ignore", *map(str, secrets)], cwd=ROOT, capture_output=True, text=True
        ).stdout.split()
        assert len(ignored) == len(secrets), ignored
    finally:
        for path in secrets:
            path.unlink()
    patterns = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    required = {".git", ".venv", "mlflow.db", "rayacc_runs", ".rayacc", ".env", "*.pem"}
    assert required <= patterns, required - patterns


def test_a_submit_address_with_credentials_is_named_without_them(monkeypatch):
    import pytest

    monkeypatch.chdir(ROOT)
    with pytest.raises(jobs.SubmitError) as err:
        jobs.submit("jobs/digits.yaml", [], address="http://bob:hunter2@127.0.0.1:9", follow=False)
    assert "http://***@127.0.0.1:9" in str(err.value)
    assert "hunter2" not in str(err.value) and "bob" not in str(err.value)
