"""Every place a config or command names is checked before anything starts: a usable scheme,
the right kind, writable or creatable (no Ray, no MLflow store is opened)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rayacc.config import TrainConfig
from rayacc.driver.places import PlaceError, check_places


def cfg(**sections) -> TrainConfig:
    return TrainConfig.from_dict(
        {"batch": {"global_batch_size": 32, "micro_batch_size": 4}, **sections}
    )


BAD_PLACES = [
    ({"run": {"storage_path": "{file}"}}, "run.storage_path", "is a file"),
    ({"run": {"storage_path": "{file}/runs"}}, "run.storage_path", "cannot be created"),
    ({"run": {"storage_path": "nosuch://bucket/x"}}, "run.storage_path", "cannot be reached"),
    ({"tracking": {"tracking_uri": "{tmp}/mlruns"}}, "tracking.tracking_uri", "file store"),
    ({"tracking": {"tracking_uri": "file://{tmp}/mlruns"}}, "tracking.tracking_uri", "3.13"),
    ({"tracking": {"tracking_uri": "ftp://host/x"}}, "tracking.tracking_uri", "sqlite:///"),
    ({"tracking": {"tracking_uri": "sqlite:///{tmp}"}}, "tracking.tracking_uri", "a folder"),
    ({"tracking": {"tracking_uri": "sqlite:///{file}/m.db"}}, "tracking.tracking_uri", "file"),
    ({"data": {"cache_dir": "{file}"}}, "data.cache_dir", "is a file"),
]


def fill(value, tmp_path: Path):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    if isinstance(value, dict):
        return {k: fill(v, tmp_path) for k, v in value.items()}
    return value.format(tmp=tmp_path, file=afile)


@pytest.mark.parametrize(("sections", "field", "says"), BAD_PLACES)
def test_a_place_that_cannot_be_used_is_named_with_its_fix(tmp_path, sections, field, says):
    with pytest.raises(PlaceError) as err:
        check_places(cfg(**fill(sections, tmp_path)))
    message = str(err.value)
    assert field in message and says in message and "Fix:" in message, message


@pytest.mark.parametrize(
    ("uri", "says"),
    [
        (s["tracking"]["tracking_uri"], says)
        for s, f, says in BAD_PLACES
        if f.startswith("tracking")
    ],
)
def test_mlflows_variable_goes_through_the_same_checks(tmp_path, monkeypatch, uri, says):
    """MLFLOW_TRACKING_URI stands in for a null tracking.tracking_uri, and is named so."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", fill(uri, tmp_path))
    with pytest.raises(PlaceError) as err:
        check_places(cfg())
    message = str(err.value)
    assert "MLFLOW_TRACKING_URI" in message and says in message and "Fix:" in message, message


def test_every_place_is_named_at_once_and_good_ones_pass(tmp_path):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    bad = cfg(
        run={"storage_path": str(afile)},
        tracking={"tracking_uri": str(tmp_path / "mlruns")},
        data={"cache_dir": str(afile)},
    )
    with pytest.raises(PlaceError) as err:
        check_places(bad)
    assert len(err.value.problems) == 3
    good = cfg(
        run={"storage_path": str(tmp_path / "new" / "runs")},
        tracking={"tracking_uri": f"sqlite:///{tmp_path / 'new2' / 'mlflow.db'}"},
        data={"cache_dir": str(tmp_path)},
    )
    check_places(good)
    assert not (tmp_path / "new").exists(), "a check creates nothing"
    check_places(cfg(tracking={"enabled": False, "tracking_uri": str(tmp_path / "x")}))


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_folder_that_cannot_be_written_is_named(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(PlaceError, match="not writable"):
            check_places(cfg(run={"storage_path": str(locked)}))
    finally:
        locked.chmod(0o700)


def test_the_commands_refuse_a_place_before_anything_starts(tmp_path, capsys, monkeypatch):
    from tests.support.services.cli import rayacc_here

    afile = tmp_path / "a-file"
    afile.write_text("x")
    for argv, flag in [
        (["report", "exp", "--out", str(afile)], "--out"),
        (["report", "exp", "--tracking-uri", "ftp://h/x"], "--tracking-uri"),
        (["data", "prepare", str(afile), "--out", str(afile)], "--out"),
    ]:
        ran = rayacc_here(argv, capsys, monkeypatch)
        assert ran.code == 2 and f"argument {flag}" in ran.err and "Fix:" in ran.err, ran


@pytest.mark.parametrize("command", ["train", "verify", "plan", "submit", "sweep"])
@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("tracking.tracking_uri=/tmp/mlruns", "tracking.tracking_uri"),
        ("model.factory=tests.support.models.bad_factories:missing", "model.factory"),
        ("run.storage_path=nosuch://bucket/runs", "run.storage_path"),
    ],
)
def test_every_command_refuses_the_same_mistakes_before_it_starts(
    tmp_path, monkeypatch, capsys, command, override, names
):
    """One validator for train, verify, plan, submit and sweep: exit 2 naming the field, no
    traceback, nothing started (no Ray here: a command that got past the checks would fail
    otherwise)."""
    import yaml

    from rayacc.cli import main

    root = Path(__file__).resolve().parents[3]
    monkeypatch.chdir(root)
    overrides = [override]
    if override.startswith("model.factory"):
        overrides.insert(0, "model.name=factory")
    job = "jobs/digits.yaml"
    if command == "sweep":
        sweep = tmp_path / "sweep.yaml"
        sweep.write_text(yaml.safe_dump({"base": str(root / job), "overrides": overrides}))
        argv = ["sweep", "-c", str(sweep)]
    elif command == "submit":
        argv = ["submit", job, *overrides, "--address", "http://127.0.0.1:9"]
    else:
        argv = [command, "-c", job, *overrides]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert names in err and "Fix:" in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("uri", "refused"),
    [
        # MLflow's own forms of a Databricks workspace
        ("databricks", False),
        ("databricks://my-profile", False),
        ("databricks-uc", False),
        ("http://mlflow.internal:5000", False),
        ("postgresql+psycopg2://u:p@db/mlflow", False),
        # MLflow's file store, however written: refused by MLflow 3
        ("file:///tmp/mlruns", True),
        ("file:/tmp/mlruns", True),
        ("/tmp/mlruns", True),
        ("mlruns", True),
    ],
)
def test_tracking_uris_are_read_as_mlflow_reads_them(uri, refused):
    from rayacc.driver.places import check_tracking_uri

    problem = check_tracking_uri("tracking.tracking_uri", uri)
    assert (problem is not None) == refused, problem
    if refused:
        assert "Fix:" in problem


@pytest.mark.parametrize("where", ["/proc/rayacc-runs", "/sys/rayacc-runs/deeper"])
def test_a_place_that_takes_no_folder_fails_by_trying_even_as_root(where, tmp_path):
    """Permission bits say yes to root everywhere; /proc and /sys take no new folders whoever
    asks. The check tries (a probe folder made and removed), so it finds out before launch."""
    from rayacc.driver.places import check_folder

    problem = check_folder("run.storage_path", where)
    assert problem is not None and "cannot be created" in problem and "Fix:" in problem
    # a writable place passes and keeps no probe
    assert check_folder("run.storage_path", str(tmp_path / "new" / "runs")) is None
    assert check_folder("run.storage_path", str(tmp_path)) is None
    assert list(tmp_path.iterdir()) == []
