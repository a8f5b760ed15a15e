"""A checkpoint folder holds exactly what its manifests list. A file none lists — named as a
foreign reader (DeepSpeed's converter, DCP) matches names, under every folder of the checkpoint,
holding a pickle that runs code — makes the folder not whole for every reader: refused naming
it, passed over by the catalogue and a resume's check, never unpickled, nothing outside the folder
opened. Crafted into the manifest, the stranger is still never handed to a reader that would
take it: the reader's view holds the manifest's files, and a DCP index names its own."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from rayacc.checkpoint import CheckpointError, RunCheckpoints, load_model, read_checkpoint
from rayacc.checkpoint.format import META_FILE, file_entry, folder_name
from rayacc.driver.prelaunch import check_resume
from rayacc.driver.runs import RunLocation
from rayacc.run.spec import ResumeTerms
from tests.support.data.checkpoints import reseal
from tests.support.data.strangers import folders_of, foreign_names, plant
from tests.support.data.tokens import gpt_checkpoint, token_data

pytest.importorskip("deepspeed")  # the names come from DeepSpeed's own constants

_OPENED: list[str] = []
_WATCHING = [False]


def _audit(event: str, args) -> None:
    if _WATCHING[0] and event == "open" and isinstance(args[0], str | bytes | os.PathLike):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("strangers")
    info = token_data(root, "chars")
    made = {}
    for kind in ("whole", "sharded"):
        storage = root / kind
        for step in (3, 6):
            folder = storage / "r" / folder_name(step)
            model = gpt_checkpoint(folder, info, sharded=kind == "sharded")
            (folder / "history.jsonl").write_text(
                "".join(json.dumps({"step": s}) + "\n" for s in range(1, step + 1))
            )
            reseal(folder)
        made[kind] = (storage, {k: v.clone() for k, v in model.state_dict().items()})
    return made


def _listing(folder: Path, stranger: Path) -> None:
    """The stranger crafted into rank 0's manifest."""
    meta = json.loads((folder / META_FILE).read_text())
    meta["files"][stranger.relative_to(folder).as_posix()] = file_entry(stranger)
    (folder / META_FILE).write_text(json.dumps(meta))


@pytest.mark.parametrize("kind", ["whole", "sharded"])
def test_a_file_no_manifest_lists_is_refused_by_every_reader_wherever_it_lies(
    written, tmp_path, kind
):
    original, weights = written[kind]
    names = foreign_names()
    cases = 0
    folders = folders_of(original / "r" / folder_name(6))
    for where_i, _ in enumerate(folders):
        for name in names:
            storage = tmp_path / f"c{cases}"
            shutil.copytree(original, storage)
            newer = storage / "r" / folder_name(6)
            where = folders_of(newer)[where_i]
            marker = tmp_path / f"ran{cases}"
            stranger = plant(where, name, marker)
            relative = stranger.relative_to(newer).as_posix()
            _WATCHING[0] = True
            _OPENED.clear()
            try:
                for read in (read_checkpoint, load_model):
                    with pytest.raises(CheckpointError) as refused:
                        read(newer)
                    assert relative in str(refused.value), (relative, str(refused.value))
                    assert "not listed by any manifest" in str(refused.value)
                run = RunCheckpoints(str(storage), "r")
                assert run.latest().step == 3 and relative in run.skipped[0], run.skipped
                loc = RunLocation(str(storage), "r")
                check_resume(
                    ResumeTerms(identity={}, global_batch_size=None, workers=1, optimizer="adamw"),
                    loc,
                )
                assert loc.resume_step == 3 and relative in loc.notes[0], loc.notes
                # crafted into the manifest: still never unpickled, the weights as written
                _listing(newer, stranger)
                loaded = load_model(newer).state_dict()
                assert all(torch.equal(loaded[k], v) for k, v in weights.items())
            finally:
                _WATCHING[0] = False
            assert not marker.exists(), f"{relative}: a reader unpickled the stranger"
            assert not [p for p in _OPENED if p.startswith(str(tmp_path)) and
                        not p.startswith(str(storage))], "opened outside the folder"  # fmt: skip
            shutil.rmtree(storage)
            cases += 1
    assert cases == len(folders) * len(names) and len(folders) >= (3 if kind == "sharded" else 2)


def test_a_restore_marks_a_checkpoint_that_did_not_load_and_every_reader_passes_it_over(
    written, tmp_path
):
    """What a restore writes when a checkpoint it chose does not load: a marker no manifest
    lists, with the reason, so the catalogue, `load_model` and a resume's check pass it over
    from then on, saying why."""
    from rayacc.checkpoint.reader import PASSED_OVER_FILE

    storage = tmp_path / "runs"
    shutil.copytree(written["whole"][0], storage)
    newer = storage / "r" / folder_name(6)
    (newer / PASSED_OVER_FILE).write_text(json.dumps({"reason": "rank 1: ZeRORuntimeException"}))
    run = RunCheckpoints(str(storage), "r")
    assert run.latest().step == 3
    assert "a restore could not load it: rank 1: ZeRORuntimeException" in run.skipped[0]
    with pytest.raises(CheckpointError, match="a restore could not load it"):
        load_model(newer)


def test_a_later_attempt_at_a_step_is_a_folder_of_its_own_and_the_newest_attempt_wins(tmp_path):
    from rayacc.checkpoint.format import attempt_of, step_of
    from tests.support.data.checkpoints import minimal_checkpoint

    assert folder_name(6, 2) == "checkpoint_step00000006_attempt2"
    assert step_of(folder_name(6, 2)) == 6 and attempt_of(folder_name(6, 2)) == 2
    assert attempt_of(folder_name(6)) == 1
    for step, attempt in ((4, 1), (6, 1), (6, 2), (6, 3)):
        minimal_checkpoint(
            tmp_path / "r" / folder_name(step, attempt),
            {"optimizer_step": step, "num_workers": attempt},
        )
    (tmp_path / "r" / folder_name(6, 3) / "parts").mkdir()
    (tmp_path / "r" / folder_name(6, 3) / "parts" / "rank_00001.json").write_text("{}")
    run = RunCheckpoints(str(tmp_path), "r")
    assert [c.name for c in run.list()][-1] == folder_name(6, 3)
    latest = run.latest()  # attempt 3 holds a stranger: attempt 2 is the step's checkpoint
    assert latest.name == folder_name(6, 2) and latest.meta()["num_workers"] == 2
