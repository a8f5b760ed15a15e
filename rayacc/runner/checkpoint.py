"""Checkpoint folders: written completely before anyone may use them; `meta.json` comes last.

A folder without `meta.json` (a crash mid-write) is never loaded; Ray Train registers a reported
checkpoint only after it has been copied whole, so the previous one stays the latest.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["CheckpointError", "load_model", "read_checkpoint", "write_checkpoint"]

STATE_FILE = "state.pt"
MODEL_FILE = "model.json"
META_FILE = "meta.json"


class CheckpointError(ValueError):
    pass


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_checkpoint(
    folder: str | Path,
    *,
    state: dict[str, Any],
    config: dict[str, Any],
    dataset: dict[str, Any],
    meta: dict[str, Any],
) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, folder / STATE_FILE)
    _atomic_write_text(folder / MODEL_FILE, json.dumps({"config": config, "dataset": dataset}))
    _atomic_write_text(folder / META_FILE, json.dumps(meta))
    return folder


def read_checkpoint(
    folder: str | Path, map_location: str | torch.device = "cpu"
) -> tuple[dict, dict, dict]:
    """(state, model description, meta) of a complete checkpoint folder."""
    folder = Path(folder)
    if not (folder / META_FILE).is_file():
        raise CheckpointError(
            f"{folder} is not a complete rayacc checkpoint (no {META_FILE}). Fix: pass the "
            "checkpoint_dir of a finished fit, or a checkpoint_* folder of the run"
        )
    try:
        # tensors, numbers, strings and plain containers only: a checkpoint from shared storage
        # or a downloaded run must not be able to run code here
        state = torch.load(folder / STATE_FILE, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{folder / STATE_FILE} holds more than tensors and plain values, so it is not "
            "loaded (it could run code). rayacc checkpoints hold only tensors, numbers, strings "
            "and plain containers. Fix: load checkpoints written by rayacc; if you trust this "
            f"file, convert it to a plain state dict ({str(exc).splitlines()[0][:200]})"
        ) from None
    description = json.loads((folder / MODEL_FILE).read_text())
    meta = json.loads((folder / META_FILE).read_text())
    return state, description, meta


def load_model(path: str | Path) -> nn.Module:
    """The model saved in a checkpoint folder, with its weights, in eval mode, on the CPU."""
    from rayacc.config import TrainConfig
    from rayacc.data.sources import DatasetInfo
    from rayacc.models import build_model

    state, description, _ = read_checkpoint(path)
    cfg = TrainConfig.model_validate(description["config"])
    model = build_model(cfg, DatasetInfo.from_dict(description["dataset"]))
    model.load_state_dict(state["model"])
    return model.eval()
