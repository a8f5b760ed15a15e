"""Nothing secret leaves the machine: credentials in URIs are masked in everything logged or
printed, and the upload and image filters keep secret files out."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from rayacc.config import TrainConfig
from rayacc.driver import jobs
from rayacc.redact import redact
from rayacc.tracking import MlflowSink

ROOT = Path(__file__).resolve().parents[3]
SECRET_URI = "http://alice:s3cr3t-pw@mlflow.internal:5000"


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        (SECRET_URI, "http://***@mlflow.internal:5000"),
        ("https://ghp_TOKEN@host/x", "https://***@host/x"),
        ("sqlite:////tmp/mlflow.db", "sqlite:////tmp/mlflow.db"),
        ("file:///tmp/x", "file:///tmp/x"),
        ("http://host/path?user=a&page=2", "http://host/path?user=a&page=2"),
        # in a message, quoted
        ("data.source='gs://svc-user:TopSecretPW@bkt/d' no", "data.source='gs://***@bkt/d' no"),
        # passwords holding `@` or `/` (unescaped)
        ("http://u:p@ss@host:5000/api", "http://***@host:5000/api"),
        ("http://u:pa/ss@host:5000/api", "http://***@host:5000/api"),
        ("s3://AKIA:a/b+c@bucket/k", "s3://***@bucket/k"),
        # tokens in query strings: presigned S3 and GCS URLs, Azure SAS, OAuth, API keys
        (
            "https://b.s3.amazonaws.com/k?X-Amz-Signature=abc&X-Amz-Date=1",
            "https://b.s3.amazonaws.com/k?X-Amz-Signature=***&X-Amz-Date=1",
        ),
        ("https://b/k?X-Amz-Security-Token=tok&x=1", "https://b/k?X-Amz-Security-Token=***&x=1"),
        (
            "https://storage.googleapis.com/b/o?X-Goog-Signature=f00",
            "https://storage.googleapis.com/b/o?X-Goog-Signature=***",
        ),
        (
            "https://a.blob.core.windows.net/c/f?sv=2020&sig=SeC%3D&se=1",
            "https://a.blob.core.windows.net/c/f?sv=2020&sig=***&se=1",
        ),
        ("https://api/x?access_token=t0k", "https://api/x?access_token=***"),
        ("https://api/x?a=1&api_key=k3y", "https://api/x?a=1&api_key=***"),
        # two URIs in one line
        ("http://a:b@h1/x and s3://k:s@h2/y", "http://***@h1/x and s3://***@h2/y"),
    ],
)
def test_credentials_in_uris_are_masked_wherever_they_stand(text, masked):
    assert redact(text) == masked
    assert redact({"a": [text, 3]}) == {"a": [masked, 3]}


def test_the_command_line_prints_no_credential_even_in_a_libraries_message(tmp_path, capsys):
    """The console's boundary: the message of the user error names the source, masked."""
    from rayacc.cli import main

    code = main(
        [
            "train",
            "-c",
            str(ROOT / "jobs/digits.yaml"),
            "data.source=ftp://alice:TopSecret@PW/x@host/x.parquet",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "ftp://***@host/x.parquet" in err and "TopSecret" not in err and "alice" not in err


def test_a_submitted_job_gets_its_credentials_in_its_environment_not_its_entrypoint(
    monkeypatch, tmp_path
):
    import json

    from rayacc.cli import parse_args
    from rayacc.cli.common import _load

    overrides = [f"tracking.tracking_uri={SECRET_URI}", "train.max_steps=3"]
    entrypoint, env = jobs.job_command(Path("jobs/digits.yaml"), overrides)
    assert "s3cr3t" not in entrypoint and "alice" not in entrypoint
    assert "train.max_steps=3" in entrypoint
    # the job's `rayacc train` reads them back from its environment
    monkeypatch.setenv(jobs.SECRET_OVERRIDES, env[jobs.SECRET_OVERRIDES])
    cfg = _load(parse_args(entrypoint.split()[3:]))
    assert cfg.tracking.tracking_uri == SECRET_URI and cfg.train.max_steps == 3
    assert json.loads(env[jobs.SECRET_OVERRIDES]) == overrides[:1]


def test_run_storage_and_checkpoint_files_hold_no_credential(tmp_path):
    """What a run writes beside its checkpoints: the run's info file, the model description,
    the identity in meta.json."""
    from rayacc.checkpoint import write_checkpoint
    from rayacc.data.bundled import prepare_bundled
    from rayacc.data.sources import describe_dataset
    from rayacc.driver.runs import RUN_INFO, RunLocation
    from rayacc.run.quantities import run_identity

    cfg = TrainConfig.from_dict(
        {
            "batch": {"global_batch_size": 32, "micro_batch_size": 4},
            "tracking": {"tracking_uri": SECRET_URI},
        }
    )
    loc = RunLocation(str(tmp_path), "run")
    loc.record(tracking_uri=SECRET_URI, data="s3://k:s3cr3t@bucket/d")
    info = describe_dataset(str(prepare_bundled("digits")))
    identity = run_identity(cfg.model_copy(update={}), info)
    write_checkpoint(
        tmp_path / "run" / "checkpoint_step00000001",
        state={},
        description={"config": cfg.model_dump(mode="json"), "dataset": info.to_dict()},
        meta={"identity": run_identity(cfg, info)},
    )
    written = [p.read_text() for p in (tmp_path / "run").rglob("*.json")]
    assert len(written) == 3 and (tmp_path / "run" / RUN_INFO).is_file()
    assert not any("s3cr3t" in text or "alice" in text for text in written), written
    assert json_identity_is_stable(identity)


def json_identity_is_stable(identity) -> bool:
    import json

    return json.loads(json.dumps(identity)) == identity


def test_a_tracking_server_reached_through_a_uri_with_userinfo_records_the_run(mlflow_server):
    """The health check speaks HTTP as MLflow's client does: the URI's userinfo is basic auth,
    not part of the host."""
    sink = MlflowSink(f"http://alice:s3cr3t@127.0.0.1:{mlflow_server}", "userinfo", "run")
    assert sink.active, sink.disabled_reason
    sink.log_params({"lr": 0.1})
    sink.finish()
    run = MlflowClient(f"http://127.0.0.1:{mlflow_server}").get_run(sink.run_id)
    assert run.data.params["lr"] == "0.1" and run.info.status == "FINISHED"


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


# every file rayacc writes, with a credential planted where a user's text reaches it
PLANTED = "https://bkt.s3.amazonaws.com/d.parquet?X-Amz-Signature=Zq9PLANTED&u=http://al:Zq9PW@h"


def _texts_drawn(monkeypatch) -> list[str]:
    """Every string matplotlib is asked to draw (titles, labels, notes, annotations)."""
    from matplotlib.axes import Axes

    drawn: list[str] = []
    for name in ("set_title", "text", "annotate", "plot", "set_xlabel", "set_ylabel"):
        original = getattr(Axes, name)

        def spy(self, *args, _original=original, **kwargs):
            drawn.extend(str(a) for a in (*args, *kwargs.values()) if isinstance(a, str))
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Axes, name, spy)
    return drawn


def _plan_file(tmp_path):
    from rayacc.planner.candidates import Candidate
    from rayacc.planner.planfile import PlanFile, made_for

    cfg = TrainConfig.from_dict(
        {"data": {"source": PLANTED}, "batch": {"global_batch_size": 8, "micro_batch_size": 4}}
    )
    chosen = Candidate(2, 4, 1)
    plan = PlanFile("job.yaml", made_for(cfg), chosen, {2: chosen}, [{"label": PLANTED}])
    path = plan.write(tmp_path / "PLAN.yaml")
    # read back and checked against the same job: the masked source still matches
    assert PlanFile.read(path).overrides_for(cfg)
    return path


def _sweep_report(tmp_path):
    from rayacc.tracking.report import Report, TrialRow, write_report

    row = TrialRow(PLANTED, "r1", "FINISHED", 2, 4, 1, 8, 0.1, 1.0, 1.0, "val/loss", 1, 1, 0.1, 1)
    report = Report("parent", [row], loss_curves={PLANTED: ([8.0, 16.0], [1.0, 0.9])})
    return write_report(report, tmp_path / "report")


def _run_report(tmp_path):
    from rayacc.tracking.run_report import SERIES, RunReport, write_run_report

    report = RunReport(
        "r1",
        f"run at {PLANTED}",
        steps=[1, 2],
        seconds=[0.0, 1.0],
        series={k: [2, 2] for k in SERIES},
        events=[(1, f"resized from {PLANTED}", "")],
    )
    return write_run_report(report, tmp_path / "run_report")


def _timings(tmp_path):
    from types import SimpleNamespace

    from rayacc.cli.train import _write_timings

    result = SimpleNamespace(
        phases={"called": 1.0},
        summary={"device": "cpu", "timeline": {}},
        checkpoint_dir=f"{PLANTED}/checkpoint_step00000001",
    )
    _write_timings(str(tmp_path / "timings.json"), result)
    return [tmp_path / "timings.json"]


@pytest.mark.parametrize("write", [_plan_file, _sweep_report, _run_report, _timings])
def test_every_file_rayacc_writes_holds_no_credential(write, tmp_path, monkeypatch):
    drawn = _texts_drawn(monkeypatch)
    write(tmp_path)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written
    for path in written:
        data = path.read_bytes()
        assert b"Zq9PLANTED" not in data and b"Zq9PW" not in data, path
    assert not [t for t in drawn if "Zq9" in t], drawn
