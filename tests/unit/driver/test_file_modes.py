"""Files rayacc writes for others — an export in each format, the tracking store it lays
out, a bundled dataset — take the modes the umask allows, as any file `open()` makes: staged
by `tempfile` (0600, a folder 0700) and renamed into place, they would shut out a serving
process or another user's MLflow UI. Every module that stages with `tempfile` is held to it."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
import torch

import rayacc
from rayacc.config import TrainConfig
from rayacc.data.sources import DatasetInfo

INFO = DatasetInfo(path="t.parquet", format="tokens", num_rows=8, vocab_size=16, max_tokens=17)
GPT = {"name": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16}
FORMATS = {"hf": {}, "safetensors": {}, "peft": {"lora": {"r": 2}}}
"""Each export format, and what its model needs."""


@pytest.fixture
def umask():
    before = os.umask(0o022)
    os.umask(before)

    def set_to(mask: int) -> None:
        os.umask(mask)

    yield set_to
    os.umask(before)


def _modes(root: Path) -> set[tuple[str, int]]:
    return {
        ("folder" if p.is_dir() else "file", stat.S_IMODE(p.stat().st_mode))
        for p in [root, *root.rglob("*")]
    }


def _checkpoint(tmp_path: Path, model_extra: dict) -> Path:
    from rayacc.checkpoint import write_checkpoint
    from rayacc.engine.parallel.state import WholeState
    from rayacc.models import build_model
    from rayacc.run.quantities import run_identity

    config = TrainConfig.model_validate({"seed": 3, "model": {**GPT, **model_extra}})
    model = build_model(config, INFO)
    trainable = [p for p in model.parameters() if p.requires_grad]
    whole, _ = WholeState().save(model, torch.optim.SGD(trainable, lr=0.1), tmp_path, 0)
    return write_checkpoint(
        tmp_path / "checkpoint",
        state={"train_state": {}, **whole},
        description={"config": config.model_dump(mode="json"), "dataset": INFO.to_dict()},
        meta={"optimizer_step": 1, "shards": None, "identity": run_identity(config, INFO)},
    )


@pytest.mark.parametrize("mask", [0o022, 0o027], ids=oct)
@pytest.mark.parametrize("fmt", FORMATS)
def test_an_export_takes_the_modes_the_umask_allows(tmp_path, umask, fmt, mask):
    pytest.importorskip("peft")
    from rayacc.driver.export import export_model

    checkpoint = _checkpoint(tmp_path, FORMATS[fmt])
    umask(mask)
    export_model(str(checkpoint), str(tmp_path / "out"), fmt=fmt)
    assert _modes(tmp_path / "out") == {("folder", 0o777 & ~mask), ("file", 0o666 & ~mask)}


@pytest.mark.parametrize("mask", [0o022, 0o077], ids=oct)
def test_the_tracking_store_laid_out_for_a_run_takes_the_umasks_modes(tmp_path, umask, mask):
    from rayacc.tracking.sqlite_store import prepare_sqlite_store

    umask(mask)
    assert prepare_sqlite_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert stat.S_IMODE((tmp_path / "mlflow.db").stat().st_mode) == 0o666 & ~mask


def test_a_bundled_dataset_takes_the_umasks_modes(tmp_path, umask):
    from rayacc.data.bundled import prepare_bundled

    umask(0o022)
    path = Path(prepare_bundled("digits", str(tmp_path)))
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


STAGES_ELSEWHERE = {
    "driver/places.py": "a probe folder, made and removed at once",
    "checkpoint/upload.py": "a staging folder whose files the storage copies anew",
}
"""Modules that stage with `tempfile` and hand nothing of it to others as it is, and why."""


def test_every_module_that_stages_with_tempfile_gives_the_umasks_modes():
    root = Path(rayacc.__file__).parent
    stages = {
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if re.search(r"tempfile\.mk[sd]temp\(", p.read_text())
    }
    gives = {m for m in stages if "umask_modes(" in (root / m).read_text()}
    assert stages - gives == set(STAGES_ELSEWHERE), stages - gives


@pytest.mark.parametrize("flag", [["export", "RUN"], ["data", "prepare", "digits"]])
@pytest.mark.parametrize("target", ["a folder", "nothing"])
def test_an_out_folder_written_whole_is_not_a_link(tmp_path, capsys, flag, target):
    # the folder is staged beside --out and renamed into place, which would replace a link:
    # refused, naming it and where it points; nothing written there or beside it
    from rayacc.cli import main

    (tmp_path / "folder").mkdir()
    link = tmp_path / "out"
    link.symlink_to(tmp_path / ("folder" if target == "a folder" else "gone"))
    with pytest.raises(SystemExit) as refused:  # argparse's exit, as for every flag
        main([*flag, "--out", str(link)])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "--out" in err and "is a link (to" in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "out"]
    assert not list((tmp_path / "folder").iterdir())
