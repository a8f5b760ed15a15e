"""Faults at the storage seam, as a cloud's store and a torn-down group produce them: a part is
put whole or the checkpoint is passed over; a retry sends the same complete files; staging is
removed on every way out; every rank's part counts; one bad folder blocks nothing else; the
run's lease is whole, checked by each heartbeat and by every rank before it commits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rayacc.checkpoint import RunCheckpoints, write_checkpoint
from rayacc.checkpoint.format import META_FILE, folder_name, part_manifest, write_part
from rayacc.checkpoint.lease import LEASE, LeaseLost, RunLease, check_lease, read_lease
from rayacc.checkpoint.storage import ArrowStorage, open_storage
from rayacc.checkpoint.upload import (
    PartUpload,
    UploadError,
    staging_folder,
    stale_staging,
    sweep_stale_staging,
)

THROTTLE = "AWS Error SLOW_DOWN during PutObject operation: Please reduce your request rate."


class FaultyStorage(ArrowStorage):
    """The seam with faults injected: the `fail_puts` first puts raise the store's throttle
    error (Ray Train retries the upload on its text); `lose` names files whose put is
    acknowledged and lost."""

    def __init__(self, root: str, fail_puts: int = 0, lose: tuple[str, ...] = ()):
        super().__init__(root)
        self.fail_puts, self.lose, self.puts = fail_puts, lose, []

    def child(self, relative: str) -> FaultyStorage:
        child = FaultyStorage(self.uri(relative), lose=self.lose)
        child.fail_puts, child.puts = self.fail_puts, self.puts
        child._parent = self
        return child

    def put_file(self, relative: str, local: Path) -> None:
        root = getattr(self, "_parent", self)
        root.puts.append(relative)
        if root.fail_puts > 0:
            root.fail_puts -= 1
            raise OSError(THROTTLE)
        if relative in self.lose:
            return
        super().put_file(relative, local)


def rank0_part(staging: Path, step: int, parts: list[str] | None = None) -> None:
    (staging / "history.jsonl").write_text(
        "".join(json.dumps({"step": s}) + "\n" for s in range(1, step + 1))
    )
    write_checkpoint(
        staging,
        state={"train_state": {"step": step}},
        description={"config": {}, "dataset": {}},
        meta={"optimizer_step": step, "parts": parts or []},
    )


def upload(storage, step: int, rank: int = 0, parts=None, **options) -> PartUpload:
    staging = staging_folder()

    def prepare() -> None:
        if rank == 0:
            rank0_part(staging, step, parts)
        else:
            (staging / "shards").mkdir(exist_ok=True)
            (staging / "shards" / f"__{rank}_0.distcp").write_bytes(os.urandom(4096))
            write_part(staging, rank=rank, step=step)

    return PartUpload(
        staging,
        storage.child(folder_name(step)),
        rank=rank,
        step=step,
        prepare=prepare,
        backoff_s=0.01,
        **options,
    )


def test_a_throttled_put_is_retried_with_the_same_whole_files(tmp_path):
    """The issue's case: one retryable error at the first put of checkpoint 2. The retry sends
    every file again (the lineage included) and the checkpoint is whole with steps 1..2."""
    run = FaultyStorage(str(tmp_path / "runs" / "r"))
    upload(run, 1).run()
    run.fail_puts = 1
    second = upload(run, 2)
    second.run()
    assert second.tries == 2 and second.done
    assert not second.staging.exists(), "staging kept after the part was in storage"
    catalogue = RunCheckpoints(str(tmp_path / "runs"), "r")
    latest = catalogue.latest()
    assert latest.step == 2 and catalogue.skipped == []
    assert [r["step"] for r in latest.history()] == [1, 2]
    # Ray Train calls the upload again when the error's text was a throttle's: nothing is
    # sent twice once the part is in storage
    sent = len(run.puts)
    second.run()
    assert len(run.puts) == sent


def test_a_part_that_never_gets_into_storage_is_abandoned_and_passed_over(tmp_path):
    run = FaultyStorage(str(tmp_path / "runs" / "r"))
    upload(run, 1).run()
    run.fail_puts = 100
    failing = upload(run, 2, attempts=3)
    with pytest.raises(UploadError, match="step 2 could not be put.*after 3 attempt"):
        failing.run()
    assert not failing.staging.exists(), "staging left behind by an abandoned upload"
    # a retry of the abandoned upload (Ray Train's, on the throttle's text) sends nothing
    sent = len(run.puts)
    with pytest.raises(UploadError):
        failing.run()
    assert len(run.puts) == sent
    assert RunCheckpoints(str(tmp_path / "runs"), "r").latest().step == 1


def test_a_put_the_store_acknowledged_and_lost_is_caught_before_the_part_counts(tmp_path):
    run = FaultyStorage(str(tmp_path / "runs" / "r"), lose=("state.pt",))
    lost = upload(run, 1, attempts=2)
    with pytest.raises(UploadError, match="state.pt is not as it was put"):
        lost.run()
    catalogue = RunCheckpoints(str(tmp_path / "runs"), "r")
    assert catalogue.latest() is None
    assert "state.pt (not there)" in catalogue.skipped[0]


def test_every_ranks_part_counts_a_checkpoint_whose_rank_1_part_never_arrived_is_not_latest(
    tmp_path,
):
    """rank 0's meta.json lists the other ranks' manifests: without rank 1's (the reclaimed
    node's) the checkpoint is not whole, for `latest`, the lineage and `rayacc runs` alike."""
    from rayacc.driver.runs import list_runs

    run = open_storage(str(tmp_path / "runs")).child("r")
    parts = [part_manifest(1)]
    for step in (3, 6):
        upload(run, step, rank=0, parts=parts).run()
        if step == 3:
            upload(run, step, rank=1).run()
    catalogue = RunCheckpoints(str(tmp_path / "runs"), "r")
    assert catalogue.latest().step == 3
    assert "parts/rank_00001.json (not there" in catalogue.skipped[0]
    assert [r["step"] for r in catalogue.lineage(3)] == [1, 2, 3]
    (summary,) = list_runs(str(tmp_path / "runs"))
    assert summary.steps_done == 3
    # rank 1's part arrives, then one of its files is cut short: passed over again
    upload(run, 6, rank=1).run()
    assert RunCheckpoints(str(tmp_path / "runs"), "r").latest().step == 6
    shard = tmp_path / "runs" / "r" / folder_name(6) / "shards" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    catalogue = RunCheckpoints(str(tmp_path / "runs"), "r")
    assert catalogue.latest().step == 3
    assert "shards/__1_0.distcp (100 of 4096 bytes)" in catalogue.skipped[0]


@pytest.mark.parametrize(
    "damage",
    [b"", b'{"optimizer_step": ', b"\xff\xfe", b"[]", b'{"optimizer_step": "4"}', "folder", "link"],
)
def test_one_bad_meta_json_blocks_no_listing_of_the_storage_path(tmp_path, capsys, damage):
    """`latest`, `rayacc runs`, a resume without a name and a named one pass over the folder
    and go on."""
    from rayacc.cli import main
    from rayacc.driver.prelaunch import check_resume
    from rayacc.driver.runs import RunLocation, list_runs
    from rayacc.run.spec import ResumeTerms

    storage = tmp_path / "runs"
    run = open_storage(str(storage)).child("r")
    upload(run, 2).run()
    upload(run, 4).run()
    upload(open_storage(str(storage)).child("other"), 5).run()
    meta = storage / "r" / folder_name(4) / META_FILE
    meta.unlink()
    if damage == "folder":
        meta.mkdir()
    elif damage == "link":
        (tmp_path / "elsewhere.json").write_text(json.dumps({"optimizer_step": 9, "files": {}}))
        meta.symlink_to(tmp_path / "elsewhere.json")
    else:
        meta.write_bytes(damage)
    catalogue = RunCheckpoints(str(storage), "r")
    assert catalogue.latest().step == 2 and len(catalogue.skipped) == 1
    assert {r.name: r.steps_done for r in list_runs(str(storage))} == {"r": 2, "other": 5}
    capsys.readouterr()
    assert main(["runs", "--storage", str(storage)]) == 0
    said = capsys.readouterr().err
    assert said.count(folder_name(4)) == 1 and "r: passed over" in said, said
    loc = RunLocation(str(storage), "r")
    check_resume(
        ResumeTerms(identity={}, global_batch_size=None, workers=1, optimizer="adamw"), loc
    )
    assert any(folder_name(4) in note for note in loc.notes), loc.notes


def test_staging_of_a_killed_process_is_swept_and_a_live_ones_kept(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = staging_folder()
    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import tempfile; tempfile.tempdir = __import__('sys').argv[1];"
            "from rayacc.checkpoint.upload import staging_folder as s;"
            "p = s(); (p / 'state.pt').write_bytes(b'x' * 1000); print(p)",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[3],
    )
    left = Path(killed.stdout.strip())
    assert left.is_dir() and stale_staging() == [left]
    assert sweep_stale_staging() == [left]
    assert not left.exists() and mine.is_dir(), "a live process's staging was swept"


# ---------------------------------------------------------------- the lease
def test_a_lease_is_never_read_torn_while_it_is_beaten(tmp_path):
    lease = RunLease(str(tmp_path), "r").take()
    seen = []
    stop = threading.Event()

    def beat():
        while not stop.is_set():
            lease.beat()

    t = threading.Thread(target=beat)
    t.start()
    try:
        for _ in range(400):
            seen.append(read_lease(str(tmp_path), "r"))
    finally:
        stop.set()
        t.join()
        lease.release()
    assert all(s is not None and s.token == lease.token for s in seen)


def test_a_holder_whose_lease_was_taken_stops_and_its_ranks_commit_nothing(tmp_path):
    said = []
    lease = RunLease(str(tmp_path), "r", on_lost=said.append).take()
    try:
        check_lease(str(tmp_path), "r", lease.token)
        # another driver took the run (this one's heartbeats had failed for longer than the
        # lease lasts, say)
        other = {"host": "elsewhere", "pid": 1, "heartbeat": time.time(), "token": "theirs"}
        (tmp_path / "r" / LEASE).write_text(json.dumps(other))
        with pytest.raises(LeaseLost, match="no longer this run's driver's"):
            check_lease(str(tmp_path), "r", lease.token)
        lease.beat()
        assert lease.lost is not None and said == [lease.lost]
        assert "taken while this driver ran it" in lease.lost and "Fix:" in lease.lost
        assert read_lease(str(tmp_path), "r").token == "theirs", "the holder wrote over it"
    finally:
        lease.release()
    assert read_lease(str(tmp_path), "r").token == "theirs", "released another driver's lease"


def test_ranks_stop_committing_when_their_drivers_heartbeats_stop(tmp_path, monkeypatch):
    """A driver that died (or cannot reach the storage) stops beating: its ranks refuse to
    commit once the heartbeat is COMMIT_FRESH_S old, before anyone may take the lease; a
    commit refused is a part abandoned, not a checkpoint half there."""
    from rayacc.checkpoint import lease as leases

    lease = RunLease(str(tmp_path), "r").take()
    lease._stop.set()  # the driver's heartbeats stop
    held = read_lease(str(tmp_path), "r")
    later = held.heartbeat + leases.COMMIT_FRESH_S + 1
    monkeypatch.setattr(leases.time, "time", lambda: later)
    with pytest.raises(LeaseLost, match="not renewed its lease"):
        check_lease(str(tmp_path), "r", lease.token)
    assert held.live(), "taken while its ranks could still commit"
    run = open_storage(str(tmp_path)).child("r")
    refused = upload(run, 1, commit=lambda: check_lease(str(tmp_path), "r", lease.token))
    with pytest.raises(UploadError, match="LeaseLost"):
        refused.run()
    assert refused.tries == 1, "a lost lease is not retried"
    assert RunCheckpoints(str(tmp_path), "r").list() == []


def test_sample_refuses_a_checkpoint_whose_weights_are_not_finite(tmp_path, capsys):
    """Found by the reader's fuzz test: flipped exponent bits in a re-sealed state.pt gave
    NaN weights and `rayacc sample` ended in torch's probability error with a traceback."""
    import torch

    from rayacc.checkpoint import read_checkpoint
    from rayacc.cli import main
    from tests.support.data.tokens import gpt_checkpoint, token_data

    folder = tmp_path / "ckpt"
    gpt_checkpoint(folder, token_data(tmp_path, "chars"), sharded=False)
    state, description, meta = read_checkpoint(folder)
    state["model"]["tok.weight"][0, 0] = float("nan")
    write_checkpoint(folder, state=state, description=description, meta=meta)
    assert torch.isnan(read_checkpoint(folder)[0]["model"]["tok.weight"]).any()
    capsys.readouterr()
    assert main(["sample", str(folder), "--tokens", "3"]) == 2
    err = capsys.readouterr().err
    assert "not finite (tok.weight" in err and "Fix:" in err and "Traceback" not in err, err


def test_sample_checks_the_vocabulary_against_the_model_before_decoding(tmp_path, capsys):
    """A vocab.json of fewer characters than the model's ids ended in IndexError."""
    from rayacc.checkpoint.format import META_FILE
    from rayacc.cli import main
    from tests.support.data.tokens import gpt_checkpoint, token_data

    folder = tmp_path / "ckpt"
    gpt_checkpoint(folder, token_data(tmp_path, "chars"), sharded=False)
    vocab = json.loads((folder / "vocab.json").read_text())
    vocab["chars"], vocab["size"] = vocab["chars"][:3], 3
    (folder / "vocab.json").write_text(json.dumps(vocab))
    meta = json.loads((folder / META_FILE).read_text())
    del meta["files"]["vocab.json"]  # re-sealed, as a crafted folder is
    (folder / META_FILE).write_text(json.dumps(meta))
    capsys.readouterr()
    assert main(["sample", str(folder), "--tokens", "50", "--temperature", "2"]) == 2
    err = capsys.readouterr().err
    assert "vocab.json does not fit the model" in err and "Fix:" in err, err
    assert "Traceback" not in err
