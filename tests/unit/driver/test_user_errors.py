"""Every class of user mistake, raised through its real call path from the command line: exit
2, one message naming the field or file and the fix, no traceback. (An error class whose own
construction failed would end in a crash here; `test_run_spec.py` also pickles each class.)"""

from __future__ import annotations

import pytest

from tests.support import ROOT
from tests.support.services.cli import rayacc_here

JOB = str(ROOT / "jobs" / "digits.yaml")


def _ckpt_damaged(tmp_path):
    from tests.support.data.tokens import gpt_checkpoint, token_data

    folder = tmp_path / "ckpt"
    gpt_checkpoint(folder, token_data(tmp_path, "chars"), sharded=False)
    (folder / "meta.json").write_text("{")
    return ["sample", str(folder)]


def _factory_missing(tmp_path):
    return ["plan", "-c", JOB, "model.name=factory", "model.factory=no_such_pkg.mod:build"]


def _empty_store(tmp_path) -> str:
    """An MLflow store that exists and holds nothing (a missing one is a place error)."""
    from rayacc.tracking.sqlite_store import prepare_sqlite_store

    uri = f"sqlite:///{tmp_path}/m.db"
    prepare_sqlite_store(uri)
    return uri


CASES = {
    # error class: (argv maker, what the message says)
    "ConfigError": (lambda t: ["plan", "-c", JOB, "batch.no_such_key=1"], "no_such_key"),
    "BatchSplitError": (
        lambda t: ["plan", "-c", JOB, "batch.micro_batch_size=7"],
        "batch.micro_batch_size",
    ),
    "DataError": (
        lambda t: ["verify", "-c", JOB, f"data.source={t}/missing.parquet"],
        "missing.parquet",
    ),
    "ModelError": (_factory_missing, "no_such_pkg"),
    "CheckpointError": (_ckpt_damaged, "meta.json"),
    "PlaceError": (lambda t: ["plan", "-c", JOB, "run.storage_path=/proc/rayacc-x"], "/proc"),
    "ReportError": (
        lambda t: ["report", "no-such-experiment", "--tracking-uri", _empty_store(t)],
        "no-such-experiment",
    ),
    "SubmitError": (lambda t: ["submit", "/tmp/elsewhere/job.yaml"], "job.yaml"),
}


@pytest.mark.parametrize("kind", CASES)
def test_each_user_mistake_is_exit_2_with_its_fix(kind, tmp_path, capsys, monkeypatch):
    make, says = CASES[kind]
    ran = rayacc_here(make(tmp_path), capsys, monkeypatch)
    assert ran.code == 2, (kind, ran)
    assert says in ran.err and "Traceback" not in ran.err, (kind, ran.err)
