"""Checkpoint folders: loading never runs code from them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from rayacc.runner.checkpoint import CheckpointError, load_model, read_checkpoint


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
