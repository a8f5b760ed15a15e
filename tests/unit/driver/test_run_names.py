"""A run name means one run: checked on the driver before Ray starts (no Ray here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rayacc.config import TrainConfig
from rayacc.data.common import DataError
from rayacc.driver.prelaunch import locate
from rayacc.driver.runs import locate_run
from rayacc.run.quantities import run_identity
from rayacc.run.spec import ResumeTerms
from tests.support.data.checkpoints import minimal_checkpoint


def resume_of(cfg, info):
    """`locate` on a resume, as the driver calls it for this config and data."""
    return locate(cfg.run, True, ResumeTerms.of(cfg, run_identity(cfg, info)))


def cfg(storage, name=None) -> TrainConfig:
    return TrainConfig.from_dict(
        {
            "batch": {"global_batch_size": 32, "micro_batch_size": 4},
            "run": {"storage_path": str(storage), "name": name},
        }
    )


def test_a_new_run_may_not_take_the_name_of_an_existing_one(tmp_path):
    (tmp_path / "exp" / "checkpoint_step00000004").mkdir(parents=True)
    with pytest.raises(DataError, match="already names a run") as err:
        locate_run(cfg(tmp_path, "exp").run, resume=False)
    assert "--resume" in str(err.value) and "run.name" in str(err.value)
    assert locate_run(cfg(tmp_path, "exp").run, resume=True).name == "exp"


def test_resume_needs_an_existing_run_of_that_name(tmp_path):
    (tmp_path / "exp").mkdir()
    with pytest.raises(DataError, match="no run named run.name='exq'") as err:
        locate_run(cfg(tmp_path, "exq").run, resume=True)
    assert "exp" in str(err.value), "the runs that exist are listed"
    assert locate_run(cfg(tmp_path, "exq").run, resume=False).name == "exq"


def test_unnamed_runs_get_fresh_names(tmp_path):
    a, b = (locate_run(cfg(tmp_path).run, resume=False) for _ in range(2))
    assert a.name != b.name


def test_resume_refuses_another_seed_order_or_dataset_listing_every_difference(tmp_path):

    import pyarrow as pa
    import pyarrow.parquet as pq

    from rayacc.data.sources import describe_dataset

    def table(n):
        return pa.table(
            {"features": [[float(i), 1.0] for i in range(n)], "label": [i % 3 for i in range(n)]}
        )

    data = tmp_path / "data.parquet"
    pq.write_table(table(64), data)

    original = cfg(tmp_path / "runs", "exp")
    original = original.model_copy(
        update={"data": original.data.model_copy(update={"source": str(data)})}
    )
    ckpt = tmp_path / "runs" / "exp" / "checkpoint_step00000004"
    meta = {"optimizer_step": 4, "identity": run_identity(original, describe_dataset(str(data)))}
    minimal_checkpoint(ckpt, meta)

    same = resume_of(original, describe_dataset(str(data)))
    assert same.name == "exp"

    other = original.model_copy(
        update={
            "seed": 7,
            "data": original.data.model_copy(update={"shuffle": False, "val_fraction": 0.2}),
        }
    )
    with pytest.raises(DataError) as err:
        resume_of(other, describe_dataset(str(data)))
    message = str(err.value)
    for field in ("seed", "data.shuffle", "data.val_fraction"):
        assert f"{field}:" in message, message
    assert "Fix:" in message

    pq.write_table(table(65), data)  # a row more: the same path, other data
    with pytest.raises(DataError, match="dataset"):
        resume_of(original, describe_dataset(str(data)))


def test_a_file_only_this_node_has_is_staged_under_the_shared_storage_once(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rayacc.data.reads import stage_file

    cache = tmp_path / "this-node-cache" / "digits.parquet"
    cache.parent.mkdir()
    pq.write_table(pa.table({"tokens": [[1, 2, 3]]}), cache)
    storage = tmp_path / "shared"
    staged = stage_file(str(cache), str(storage))
    assert Path(staged) == storage / "_data" / "digits.parquet"
    assert Path(staged).read_bytes() == cache.read_bytes()
    mtime = Path(staged).stat().st_mtime_ns
    assert stage_file(str(cache), str(storage)) == staged
    assert Path(staged).stat().st_mtime_ns == mtime, "copied again"
    uri = stage_file(str(cache), f"file://{tmp_path / 'bucket'}")
    assert uri == f"file://{tmp_path / 'bucket'}/_data/digits.parquet"
    # the staging folder is not a run
    from rayacc.driver.runs import list_runs

    assert list_runs(str(storage)) == []


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ({"batch": {"global_batch_size": 64, "micro_batch_size": 4}}, True),
        # micro × accumulation without a global batch: the worker count changes it
        (
            {
                "batch": {"micro_batch_size": 4, "grad_accum_steps": 4},
                "scaling": {"num_workers": 1},
            },
            True,
        ),
        (
            {
                "batch": {"micro_batch_size": 8, "grad_accum_steps": 2},
                "scaling": {"num_workers": 2},
            },
            False,
        ),
        # an elastic run that keeps the micro-batch may change it
        (
            {
                "batch": {"global_batch_size": 64, "micro_batch_size": 4},
                "scaling": {"num_workers": [1, 4], "on_resize": "keep_micro_batch"},
            },
            False,
        ),
    ],
)
def test_resume_with_another_global_batch_is_refused_before_launch(tmp_path, change, refused):
    """The checkpoint was trained at global batch 32 on 2 workers: a run that keeps the global
    batch and now resolves to another is refused on the driver (exit 2), not in the workers."""

    from rayacc.data.sources import describe_dataset

    data = tmp_path / "data.parquet"
    _classification_file(data)
    base = {
        "data": {"source": str(data)},
        "run": {"storage_path": str(tmp_path / "runs"), "name": "exp"},
    }
    original = TrainConfig.from_dict(
        {**base, "batch": {"global_batch_size": 32, "micro_batch_size": 4}}
    )

    ckpt = tmp_path / "runs" / "exp" / "checkpoint_step00000004"
    info = describe_dataset(str(data))
    meta = {"optimizer_step": 4, "global_batch_size": 32, "identity": run_identity(original, info)}
    minimal_checkpoint(ckpt, meta)

    resumed = TrainConfig.from_dict({**base, **change})
    if not refused:
        assert resume_of(resumed, info).name == "exp"
        return
    with pytest.raises(DataError) as err:
        resume_of(resumed, info)
    assert "batch.global_batch_size: the run has 32" in str(err.value)
    assert "set batch.global_batch_size: 32" in str(err.value)


def _classification_file(path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table(
            {"features": [[float(i), 1.0] for i in range(64)], "label": [i % 3 for i in range(64)]}
        ),
        path,
    )


@pytest.mark.parametrize(
    ("runs", "job", "picked"),
    [
        # (name, identity, started) of the runs in the storage path; this job's identity
        ([("mlp-a", "mlp", "1"), ("gpt-a", "gpt", "2")], "mlp", "mlp-a"),  # not the latest
        ([("mlp-a", "mlp", "1"), ("mlp-b", "mlp", "3"), ("gpt", "gpt", "4")], "mlp", "mlp-b"),
        ([("gpt-a", "gpt", "1")], "mlp", None),  # none of this job: refused, runs listed
        ([], "mlp", None),
    ],
)
def test_resume_without_a_name_takes_the_latest_run_of_the_same_job(tmp_path, runs, job, picked):

    from rayacc.driver.runs import RUN_INFO

    for name, identity, started in runs:
        (tmp_path / name).mkdir()
        info = {"identity": {"model.name": identity}, "started": started, "job": f"{name}.yaml"}
        (tmp_path / name / RUN_INFO).write_text(json.dumps(info))
    identity = {"model.name": job}
    if picked is not None:
        assert locate_run(cfg(tmp_path).run, resume=True, identity=identity).name == picked
        return
    with pytest.raises(DataError, match="no run in .* was trained on this job") as err:
        locate_run(cfg(tmp_path).run, resume=True, identity=identity)
    for name, _, _ in runs:
        assert name in str(err.value), "the runs there are listed"
    assert "run.name=NAME" in str(err.value) and "rayacc runs" in str(err.value)


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("exp-1_a.b", True),
        ("A", True),
        ("team/exp1", False),  # a folder inside another
        ("..", False),  # outside the storage path
        ("../x", False),
        (".hidden", False),
        ("_data", False),  # where shared data is staged
        ("a b", False),
        ("x" * 129, False),
        ("", False),
        ("run\\x", False),
    ],
)
def test_run_names_are_plain_folder_names(name, ok):
    from rayacc.config import ConfigError

    if ok:
        assert cfg("/tmp", name).run.name == name
        return
    with pytest.raises(ConfigError, match=r"run\.name") as err:
        cfg("/tmp", name)
    assert "letters, digits" in str(err.value), "the message says what a name may hold"


def test_staging_writes_a_name_of_its_own_and_renames_it(tmp_path, monkeypatch):
    """Sweep trials that share a storage path stage the same file at once: none may ever see
    the target half-written."""
    import pyarrow.fs as pafs

    from rayacc.data.reads import stage_file

    cache = tmp_path / "cache" / "digits.parquet"
    cache.parent.mkdir()
    cache.write_bytes(b"x" * 1000)
    target = tmp_path / "shared" / "_data" / "digits.parquet"
    copy = pafs.copy_files
    written = []

    def watched(source, destination, *args, **kwargs):
        written.append(destination)
        assert not target.exists(), "the target is already there while it is written"
        copy(source, destination, *args, **kwargs)

    monkeypatch.setattr(pafs, "copy_files", watched)
    assert stage_file(str(cache), str(tmp_path / "shared")) == str(target)
    assert written and all(Path(w) != target for w in written)
    assert target.read_bytes() == cache.read_bytes()
    assert sorted(p.name for p in target.parent.iterdir()) == ["digits.parquet"]


def test_runs_lists_the_runs_of_a_storage_path(tmp_path, capsys):
    """`rayacc runs` reads what runs leave in their folders: no Ray, no MLflow."""
    from rayacc.driver.runs import list_runs, locate_run

    cfg = TrainConfig.from_dict(
        {
            "batch": {"global_batch_size": 32, "micro_batch_size": 4},
            "run": {"storage_path": str(tmp_path), "name": "a"},
        }
    )
    loc = locate_run(cfg.run, resume=False)
    loc.record(
        job="jobs/digits.yaml",
        model="mlp",
        data="digits",
        total_steps=10,
        status="running",
        mlflow_run_id="abc",
    )
    ckpt = tmp_path / "a" / "checkpoint_step00000004"
    minimal_checkpoint(ckpt, {"optimizer_step": 4})
    (tmp_path / "a" / "checkpoint_step00000006").mkdir()  # never completed: not listed
    (run,) = list_runs(str(tmp_path))
    assert (run.name, run.steps_done, run.total_steps) == ("a", 4, 10)
    assert run.status == "unfinished" and run.mlflow_run_id == "abc"
    assert run.last_checkpoint.endswith("checkpoint_step00000004")

    from rayacc.cli import parse_args

    args = parse_args(["runs", "--storage", str(tmp_path)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    for shown in ("a", "jobs/digits.yaml", "mlp / digits", "4/10", "checkpoint_step00000004"):
        assert shown in out, (shown, out)
    assert "abc" in out and "unfinished" in out


# ---------------------------------------------------------------- one writer per run
def _finished_run(tmp_path, name: str, identity: dict, started: str):

    folder = tmp_path / "runs" / name
    minimal_checkpoint(
        folder / "checkpoint_step00000004", {"optimizer_step": 4, "identity": identity}
    )
    info = {"status": "finished", "identity": identity, "started": started}
    (folder / "rayacc_run.json").write_text(json.dumps(info))


def test_a_live_driver_holds_its_run_and_a_killed_ones_lease_expires(tmp_path, monkeypatch):
    import time

    from rayacc.checkpoint import lease as leases
    from rayacc.checkpoint.lease import LEASE, RunLease
    from rayacc.data.common import DataError
    from rayacc.driver.runs import list_runs, locate_run

    storage = str(tmp_path / "runs")
    ident = {"seed": 0}
    _finished_run(tmp_path, "old", ident, "2026-01-01 00:00:00")
    _finished_run(tmp_path, "new", ident, "2026-01-02 00:00:00")
    held = RunLease(storage, "new").take()
    try:
        by_name = {r.name: r for r in list_runs(storage)}
        assert by_name["new"].status == "running" and by_name["old"].status == "finished"
        # a second driver: neither a named resume nor its own lease may take the run
        with pytest.raises(DataError, match=r"'new' .* live driver \(host .*pid") as named:
            locate_run(cfg(storage, "new").run, resume=True)
        assert "Fix:" in str(named.value)
        with pytest.raises(DataError, match="live driver"):
            RunLease(storage, "new").take()
        # an unnamed resume passes over the live run and says so
        loc = locate_run(cfg(storage, None).run, resume=True, identity=ident)
        assert loc.name == "old" and "passed over run 'new'" in loc.notes[0]
    finally:
        held.release()
    assert not (tmp_path / "runs" / "new" / LEASE).exists()
    assert locate_run(cfg(storage, None).run, resume=True, identity=ident).name == "new"

    # a lease left by a driver that was killed: expired by its heartbeat's age, or on this
    # host, when its process is gone, once its workers stopped committing (DEAD_HOLDER_S)
    lease_file = tmp_path / "runs" / "new" / LEASE
    stale = {"host": "elsewhere", "pid": 1, "heartbeat": time.time() - leases.LEASE_TTL_S - 1}
    lease_file.write_text(json.dumps({**stale, "token": "t"}))
    assert {r.name: r.status for r in list_runs(storage)}["new"] == "finished"
    import socket
    import subprocess
    import sys

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    beat = time.time() - leases.DEAD_HOLDER_S + 1.0
    dead = {"host": socket.gethostname(), "pid": int(gone.stdout), "heartbeat": beat}
    lease_file.write_text(json.dumps({**dead, "token": "t"}))
    assert {r.name: r.status for r in list_runs(storage)}["new"] == "finished", (
        "a gone driver listed as running"
    )
    waited = time.monotonic()
    RunLease(storage, "new").take().release()
    assert time.monotonic() - waited >= 0.8, "taken before the gone driver's workers stopped"
    # a live one of another host, written this moment
    fresh = {"host": "elsewhere", "pid": 1, "heartbeat": time.time(), "token": "t"}
    lease_file.write_text(json.dumps(fresh))
    assert {r.name: r.status for r in list_runs(storage)}["new"] == "running"


@pytest.mark.parametrize("damage", [b"{not json", b"[1, 2]", b"\xff\x00\x80", b'{"status": "fin'])
def test_a_damaged_run_info_is_named_on_resume_and_marked_in_the_listing(tmp_path, damage):

    from rayacc.checkpoint.lease import LEASE
    from rayacc.data.common import DataError
    from rayacc.driver.runs import RUN_INFO, list_runs, locate_run

    storage = tmp_path / "runs"
    _finished_run(tmp_path, "good", {"seed": 0}, "2026-01-01 00:00:00")
    _finished_run(tmp_path, "bad", {"seed": 0}, "2026-01-02 00:00:00")
    (storage / "bad" / RUN_INFO).write_bytes(damage)
    # a lease torn or overwritten with bytes is no claim
    (storage / "bad" / LEASE).write_bytes(damage)
    with pytest.raises(DataError, match=rf"bad/{RUN_INFO} is not the JSON") as refused:
        locate_run(cfg(storage, "bad").run, resume=True)
    assert "Fix:" in str(refused.value)
    status = {r.name: r.status for r in list_runs(str(storage))}
    assert status == {"good": "finished", "bad": f"unknown ({RUN_INFO} damaged)"}
    assert json.loads((storage / "good" / RUN_INFO).read_text())["status"] == "finished"
