"""Checkpoint folders: written completely before anyone may use them; `meta.json` comes last.

A folder without `meta.json` (a crash mid-write) is never loaded; Ray Train registers a reported
checkpoint only after every rank's part has been copied whole, so the previous one stays the
latest. A sharded (FSDP) run's folder holds the model and optimizer state as every rank's shards
under `shards/` (engine/shards.py; `meta.json` says so) and `state.pt` holds the rest; a folder
whose index names a shard file that is not there is refused.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rayacc.engine.strategy import SHARDS_DIR

__all__ = [
    "SHARDS_DIR",
    "CheckpointError",
    "load_model",
    "read_checkpoint",
    "shards_of",
    "write_checkpoint",
]

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
    shards = shards_of(folder, meta)
    if shards is not None:
        from rayacc.engine.shards import ShardError, missing_shard_files

        try:
            missing = missing_shard_files(shards)
        except ShardError as exc:
            raise CheckpointError(str(exc)) from None
        if missing:
            raise CheckpointError(
                f"{shards} lacks {', '.join(missing[:4])}: a rank's part of this sharded "
                "checkpoint never arrived, so it is not loaded. Fix: resume from an earlier "
                "checkpoint_* folder of the run"
            )
    return state, description, meta


def shards_of(folder: str | Path, meta: dict[str, Any]) -> Path | None:
    """The folder of a sharded checkpoint's model and optimizer shards; None when the model
    is whole in `state.pt`."""
    return Path(folder) / meta["shards"] if meta.get("shards") else None


def load_model(path: str | Path) -> nn.Module:
    """The model saved in a checkpoint folder, with its weights, in eval mode, on the CPU."""
    from rayacc.config import TrainConfig
    from rayacc.data.sources import DatasetInfo
    from rayacc.models import build_model

    state, description, meta = read_checkpoint(path)
    cfg = TrainConfig.model_validate(description["config"])
    model = build_model(cfg, DatasetInfo.from_dict(description["dataset"]))
    shards = shards_of(path, meta)
    if shards is None:
        model.load_state_dict(state["model"])
    else:
        from rayacc.engine.shards import load_model_shards

        load_model_shards(shards, model)
    return model.eval()


class RunCheckpoints:
    """A worker's checkpoints: the strategy's model and optimizer state (whole, or every rank's
    shards), the stateful `parts` (schedule, scaler, train state: anything with `state_dict` /
    `load_state_dict`, by name) and every rank's random state. Every rank calls `save` (a
    barrier: Ray Train's report) and `restore`."""

    def __init__(self, strategy, optimizer, parts: dict[str, Any], *, rank, world, device, seed):
        self.strategy, self.optimizer, self.parts = strategy, optimizer, parts
        self.rank, self.world, self.device, self.seed = rank, world, device, seed

    def restore(self) -> dict[str, Any] | None:
        """Loads the run's latest checkpoint, if any, and returns its meta."""
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        with checkpoint.as_directory() as folder:
            saved, _, meta = read_checkpoint(folder, map_location=self.device)
            self.strategy.load(self.optimizer, folder, saved)
        for name, part in self.parts.items():
            if part is not None and saved.get(name) is not None:
                part.load_state_dict(saved[name])
        self._restore_rng(saved.get("rng"), meta["optimizer_step"])
        return meta

    def save(self, metrics: dict[str, Any], *, step: int, description: dict, meta: dict) -> None:
        """Every rank reports (a barrier). Rank 0 writes the folder, with every rank's random
        state; a strategy that shards has every rank write its part first (Ray Train merges
        the parts into one checkpoint folder in the run's storage)."""
        import tempfile

        import ray.train

        from rayacc.engine import all_gather_objects

        rng = all_gather_objects(self._rng_state())
        with tempfile.TemporaryDirectory() as tmp:
            whole = self.strategy.save(self.optimizer, tmp, self.rank)
            if self.rank == 0:
                state = {
                    name: p.state_dict() if p is not None else None
                    for name, p in self.parts.items()
                }
                write_checkpoint(
                    tmp,
                    state={**whole, **state, "rng": rng},
                    config=description["config"],
                    dataset=description["dataset"],
                    meta={**meta, "shards": SHARDS_DIR if self.strategy.writes_shards else None},
                )
            has_part = self.rank == 0 or self.strategy.writes_shards
            ray.train.report(
                metrics,
                checkpoint=ray.train.Checkpoint.from_directory(tmp) if has_part else None,
                checkpoint_dir_name=f"checkpoint_step{step:08d}",
            )

    def _rng_state(self) -> dict[str, torch.Tensor | None]:
        cuda = self.device.type == "cuda"
        return {
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(self.device) if cuda else None,
        }

    def _restore_rng(self, saved: list[dict[str, torch.Tensor | None]] | None, step: int) -> None:
        """This rank's random state as the checkpoint left it, so a resumed run draws what an
        uninterrupted one would; after a resize (other ranks) a fresh stream of its own,
        seeded by the step."""
        from rayacc.quantities import rank_seed

        if saved is None or len(saved) != self.world:
            torch.manual_seed(rank_seed(self.seed, self.rank, step))
            return
        mine = saved[self.rank]
        torch.set_rng_state(mine["cpu"].cpu())
        if mine["cuda"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(mine["cuda"].cpu(), self.device)
