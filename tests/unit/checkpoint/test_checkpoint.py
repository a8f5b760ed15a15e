"""Checkpoint folders: loading never runs code from them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from rayacc.checkpoint import CheckpointError, load_model, read_checkpoint


class _Payload:
    """Unpickling this runs `os.system` — what a crafted checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def crafted_checkpoint(folder: Path, marker: Path) -> Path:
    folder.mkdir()
    torch.save({"model": {"w": torch.zeros(2)}, "hook": _Payload(marker)}, folder / "state.pt")
    (folder / "model.json").write_text(json.dumps({"config": {}, "dataset": {}}))
    (folder / "meta.json").write_text(json.dumps({"optimizer_step": 1}))
    return folder


@pytest.mark.parametrize("load", [read_checkpoint, load_model], ids=["read", "load_model"])
def test_a_checkpoint_holding_code_is_refused_without_running_it(tmp_path, load):
    marker = tmp_path / "code-ran"
    folder = crafted_checkpoint(tmp_path / "ckpt", marker)
    with pytest.raises(CheckpointError, match="only tensors, numbers, strings"):
        load(folder)
    assert not marker.exists(), "loading the checkpoint ran its code"


# ---------------------------------------------------------------- sharded (FSDP) checkpoints
def sharded_checkpoint(folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A complete sharded checkpoint folder as a one-process sharded run writes it (shards,
    then `state.pt`, `model.json`, `meta.json`), of a GPT moved off its initial weights;
    returns the folder and the weights it holds."""
    from rayacc.checkpoint import SHARDS_DIR, write_checkpoint
    from rayacc.engine.parallel.shards import save_sharded
    from rayacc.models import build_model
    from tests.support.ranks.fsdp_workers import seeded_config

    cfg, info = seeded_config()
    model = build_model(cfg, info)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    save_sharded(folder / SHARDS_DIR, model, torch.optim.AdamW(model.parameters()))
    write_checkpoint(
        folder,
        state={"train_state": {}},
        description={"config": cfg.model_dump(mode="json"), "dataset": info.to_dict()},
        meta={"optimizer_step": 1, "shards": SHARDS_DIR},
    )
    return folder, {k: v.detach().clone() for k, v in model.state_dict().items()}


def listing_only(folder: Path, *kept: str) -> None:
    """meta.json made to list only `kept` of the folder's files, the others as another rank's
    part lists them (rank 0 lists its own), as a crafted folder would."""
    meta = json.loads((folder / "meta.json").read_text())
    from rayacc.checkpoint.format import file_entry

    others = {
        n: file_entry(folder / n) for n in meta["files"] if n not in kept and (folder / n).exists()
    }
    meta["files"] = {n: e for n, e in meta["files"].items() if n in kept}
    meta["parts"] = ["parts/rank_00001.json"]
    (folder / "parts").mkdir(exist_ok=True)
    (folder / "parts" / "rank_00001.json").write_text(json.dumps({"rank": 1, "files": others}))
    (folder / "meta.json").write_text(json.dumps(meta))


def test_load_model_reads_a_sharded_checkpoint_whole(tmp_path):
    folder, weights = sharded_checkpoint(tmp_path / "ckpt")
    model = load_model(folder)
    assert model.state_dict().keys() == weights.keys()
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name


def test_a_sharded_checkpoint_missing_a_rank_part_is_refused(tmp_path):
    folder, _ = sharded_checkpoint(tmp_path / "ckpt")
    (folder / "shards" / "__0_0.distcp").unlink()
    listing_only(folder, "state.pt", "model.json")  # the shards: another rank's part
    with pytest.raises(CheckpointError, match=r"lacks __0_0\.distcp.*never arrived"):
        load_model(folder)


def test_a_sharded_index_holding_code_is_refused_without_running_it(tmp_path):
    import pickle

    marker = tmp_path / "code-ran"
    folder, _ = sharded_checkpoint(tmp_path / "ckpt")
    (folder / "shards" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    listing_only(folder, "state.pt", "model.json")  # crafted to match
    with pytest.raises(CheckpointError, match="could run code"):
        load_model(folder)
    assert not marker.exists(), "reading the index ran its code"


class _WithExtraState(torch.nn.Linear):
    """A module whose state dict carries an object (`get_extra_state`): DCP stores it as a
    pickled value."""

    extra: object = None

    def get_extra_state(self):
        return self.extra

    def set_extra_state(self, state) -> None:
        self.extra = state


def test_a_sharded_value_holding_code_is_refused_without_running_it(tmp_path):
    from rayacc.engine.parallel.shards import ShardError, load_model_shards, save_sharded

    marker = tmp_path / "code-ran"
    written = _WithExtraState(2, 2)
    written.extra = _Payload(marker)
    save_sharded(tmp_path / "shards", written, torch.optim.SGD(written.parameters(), lr=0.1))
    with pytest.raises(ShardError, match="could run code"):
        load_model_shards(tmp_path / "shards", _WithExtraState(2, 2))
    assert not marker.exists(), "loading a value ran its code"


@pytest.mark.parametrize(
    "outside", ["../outside.distcp", "/etc/hostname", "sub/../../outside.distcp", "../ckpt2/x"]
)
@pytest.mark.parametrize("where", ["index", "meta"])
def test_a_sharded_checkpoint_naming_a_file_outside_its_folder_is_refused(tmp_path, outside, where):
    """A crafted DCP index (`relative_path`) or meta.json (`shards`) must not make the loader
    read files anywhere on disk."""
    import json
    import pickle

    from rayacc.engine.parallel.shards import _IndexUnpickler

    folder, _ = sharded_checkpoint(tmp_path / "ckpt")
    (tmp_path / "outside.distcp").write_bytes(b"not yours")
    if where == "index":
        index = folder / "shards" / ".metadata"
        with open(index, "rb") as f:
            metadata = _IndexUnpickler(f).load()
        for info in metadata.storage_data.values():
            info.relative_path = outside
        index.write_bytes(pickle.dumps(metadata))
        listing_only(folder, "state.pt", "model.json")  # crafted to match
    else:
        meta = json.loads((folder / "meta.json").read_text())
        (folder / "meta.json").write_text(json.dumps({**meta, "shards": outside}))
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        load_model(folder)
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        read_checkpoint(folder)


# ---------------------------------------------------------------- a user factory's checkpoint
def factory_checkpoint(folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint of `tests.support.models.planted_factory:build`'s model (width 3)."""
    from rayacc import TrainConfig
    from rayacc.checkpoint import write_checkpoint
    from rayacc.data.sources import DatasetInfo

    cfg = TrainConfig.from_dict(
        {
            "model": {
                "name": "factory",
                "factory": "tests.support.models.planted_factory:build",
                "kwargs": {"width": 3},
            },
            "batch": {"global_batch_size": 8},
        }
    )
    info = DatasetInfo(
        path="d.parquet", format="classification", num_rows=8, num_features=5, num_classes=3
    )
    model = torch.nn.Linear(5, 3)
    write_checkpoint(
        folder,
        state={"model": model.state_dict()},
        description={"config": cfg.model_dump(mode="json"), "dataset": info.to_dict()},
        meta={"optimizer_step": 1},
    )
    return folder, model.state_dict()


def test_a_factory_checkpoint_loads_only_with_the_factory_its_caller_names(tmp_path, monkeypatch):
    import sys

    from rayacc.cli import main

    mark = tmp_path / "imported"
    monkeypatch.setenv("RAYACC_PLANTED_MARK", str(mark))
    monkeypatch.delitem(sys.modules, "tests.support.models.planted_factory", raising=False)
    folder, weights = factory_checkpoint(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="factory=.*you trust") as refused:
        load_model(folder)
    assert "tests.support.models.planted_factory:build" in str(refused.value)
    # the command line says the same, exit 2, before importing anything of it
    assert main(["sample", str(folder), "--tokens", "1"]) == 2
    assert not mark.exists() and "tests.support.models.planted_factory" not in sys.modules
    # named by the caller, it is the caller's code: imported, called with the saved kwargs
    model = load_model(folder, factory="tests.support.models.planted_factory:build")
    assert mark.exists()
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    with pytest.raises(CheckpointError, match="built-in model"):
        folder2, _ = sharded_checkpoint(tmp_path / "gpt")
        load_model(folder2, factory="tests.support.models.planted_factory:build")


def test_the_lineage_spool_leaves_nothing_in_the_temp_folder(tmp_path, monkeypatch):
    """Rank 0 spools the run's step records to a file of its own; a group's process may end at
    any moment (a resize, a failure), so the file has no name to leave behind."""
    import tempfile

    from rayacc.checkpoint import StepLog

    spool = tmp_path / "tmp"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))
    logs = [StepLog() for _ in range(3)]  # three groups of one run (restarts, resizes)
    for i, log in enumerate(logs):
        log.append({"step": 1, "group": i})
    assert list(spool.iterdir()) == []
    saved = tmp_path / "history.jsonl"
    logs[0].copy_to(saved)
    logs[1].load(saved)
    logs[1].append({"step": 2})
    logs[1].copy_to(saved)
    lines = [json.loads(line) for line in saved.read_text().splitlines()]
    assert lines == [{"step": 1, "group": 0}, {"step": 2}]
    logs[2].load(tmp_path / "none.jsonl")  # no lineage yet: an empty one
    logs[2].copy_to(saved)
    assert saved.read_text() == ""


# ---------------------------------------------------------------- files read back, damaged
DAMAGE = {
    "truncated": lambda data: data[: len(data) // 2],
    "not JSON": lambda data: b"\x00\x01 not json",
    "not text": lambda data: b"\xff\x00\xfe\x80 binary",
    "empty": lambda data: b"",
    "another shape": lambda data: b"[1, 2, 3]",
    "wrong types": lambda data: json.dumps(
        {k: "x" for k in ("kind", "size", "optimizer_step", "step", "config", "dataset")}
    ).encode(),
}
"""Ways a file rayacc wrote comes back damaged: each must be exit 2 naming the file."""


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize(
    "file",
    ["meta.json", "model.json", "vocab.json", "history.jsonl", "state.pt", "shards/.metadata"],
)
def test_a_damaged_file_of_a_checkpoint_is_named_with_the_fix(tmp_path, capsys, file, how):
    """Through `rayacc sample` (which reads the vocabulary, the description, the state and a
    sharded checkpoint's index) and the run's lineage, the way `fit` reads it back: exit 2
    naming the file, never a traceback."""
    from rayacc.checkpoint import RunCheckpoints
    from rayacc.cli import main
    from tests.support.data.checkpoints import reseal
    from tests.support.data.tokens import gpt_checkpoint, token_data

    storage = tmp_path / "runs"
    run = RunCheckpoints(str(storage), "r")
    checkpoint = storage / "r" / run.folder_name(3)
    sharded = file.startswith("shards/")
    gpt_checkpoint(checkpoint, token_data(tmp_path, "chars"), sharded=sharded)
    (checkpoint / "history.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    reseal(checkpoint)
    target = checkpoint / file
    target.write_bytes(DAMAGE[how](target.read_bytes()))
    if file == "history.jsonl":
        (listed,) = run.list()
        with pytest.raises(CheckpointError, match="history.jsonl") as refused:
            listed.history()
        assert "Fix:" in str(refused.value)
        return
    capsys.readouterr()
    assert main(["sample", str(checkpoint), "--tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert Path(file).name in err and "Fix:" in err and "Traceback" not in err, err
    assert "could run code" not in err, "a damaged file is not a dangerous one"


# ---------------------------------------------------------------- a copy into storage cut short
def _cut(name: str, how: str):
    def cut(folder: Path) -> None:
        target = folder / name
        if how == "gone":
            target.unlink()
        else:
            target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])

    return cut


def _before_the_manifest(folder: Path) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    del meta["files"]
    (folder / "meta.json").write_text(json.dumps(meta))


def _manifest_outside(folder: Path) -> None:
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"]["../elsewhere.pt"] = 1
    (folder / "meta.json").write_text(json.dumps(meta))


CUT_SHORT = {
    # case: (sharded, what happened to the newer checkpoint's folder, the file named)
    "state.pt not there": (False, _cut("state.pt", "gone"), "state.pt (not there)"),
    "state.pt half copied": (False, _cut("state.pt", "half"), "state.pt ("),
    "lineage not there": (False, _cut("history.jsonl", "gone"), "history.jsonl (not there)"),
    "lineage half copied": (False, _cut("history.jsonl", "half"), "history.jsonl ("),
    "description not there": (False, _cut("model.json", "gone"), "model.json (not there)"),
    "vocabulary not there": (False, _cut("vocab.json", "gone"), "vocab.json (not there)"),
    "shard index not there": (True, _cut("shards/.metadata", "gone"), "shards/.metadata"),
    "a name outside the folder": (False, _manifest_outside, "../elsewhere.pt (not inside"),
}


@pytest.mark.parametrize("case", CUT_SHORT)
def test_a_checkpoint_whose_copy_was_cut_short_is_passed_over_and_said(tmp_path, capsys, case):
    """meta.json lists every other file of the folder and its size: a folder whose copy into
    storage was cut short (meta.json there, another file missing or short) is not the run's
    latest, not its lineage, not loaded, and each command that passes it over says so."""
    from rayacc.checkpoint import RunCheckpoints
    from rayacc.cli import main
    from tests.support.data.checkpoints import reseal
    from tests.support.data.tokens import gpt_checkpoint, token_data

    sharded, damage, named = CUT_SHORT[case]
    info = token_data(tmp_path, "chars")
    storage = tmp_path / "runs"
    run = RunCheckpoints(str(storage), "r")
    for step in (3, 6):
        folder = storage / "r" / run.folder_name(step)
        gpt_checkpoint(folder, info, sharded=sharded)
        lines = "".join(json.dumps({"step": s}) + "\n" for s in range(1, step + 1))
        (folder / "history.jsonl").write_text(lines)
        reseal(folder)  # as a run writes it: the lineage among the files meta.json lists
    newer = storage / "r" / run.folder_name(6)
    assert run.latest().step == 6 and run.latest().missing() == []
    damage(newer)

    assert run.latest().step == 3
    (note,) = run.skipped
    assert named in note and str(newer) in note, note
    assert [r["step"] for r in run.lineage(3)] == [1, 2, 3]
    assert run.lineage(5) == [], "the lineage is not read from a folder that is not whole"
    with pytest.raises(CheckpointError, match="not a whole checkpoint") as refused:
        read_checkpoint(newer)
    assert named in str(refused.value) and "Fix:" in str(refused.value)
    capsys.readouterr()
    assert main(["sample", "r", "--storage", str(storage), "--tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert f"passed over {newer}" in err and named in err, err
    assert f"from {storage / 'r' / run.folder_name(3)}" in err, err
    # a --resume's check of the run (its notes are printed before training)
    from rayacc.driver.prelaunch import check_resume
    from rayacc.driver.runs import RunLocation
    from rayacc.run.spec import ResumeTerms

    loc = RunLocation(str(storage), "r")
    check_resume(
        ResumeTerms(identity={}, global_batch_size=None, workers=1, optimizer="adamw"), loc
    )
    (said,) = loc.notes
    assert said.startswith(f"passed over {newer}") and named in said, said


def test_a_checkpoint_written_before_meta_listed_its_files_is_taken_on_its_meta(tmp_path):
    from rayacc.checkpoint import RunCheckpoints
    from tests.support.data.tokens import gpt_checkpoint, token_data

    run = RunCheckpoints(str(tmp_path), "r")
    folder = tmp_path / "r" / run.folder_name(4)
    gpt_checkpoint(folder, token_data(tmp_path, "chars"), sharded=False)
    _before_the_manifest(folder)
    assert run.latest().step == 4 and run.skipped == []
    assert read_checkpoint(folder)[2]["optimizer_step"] == 3


def test_load_model_takes_a_run_folder_as_sample_and_export_do(tmp_path):
    """`load_model(run_dir)` refused the run folder `sample` and `export` accept: it reads the
    run's newest whole checkpoint (one not whole is passed over)."""
    from rayacc.checkpoint.format import folder_name

    run = tmp_path / "runs" / "digits"
    _, weights = sharded_checkpoint(run / folder_name(3))
    newer, _ = sharded_checkpoint(run / folder_name(6))
    (newer / "shards" / "__0_0.distcp").unlink()  # not whole
    model = load_model(run)
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    with pytest.raises(CheckpointError):
        load_model(tmp_path / "runs")  # a folder of runs is no run
