"""What a checkpoint is on storage: its folder's name, its files, and the manifests that say
when it is whole.

A checkpoint is the folder `checkpoint_step{step:08d}` in the run's folder `storage/name`
(`..._attemptN` when an earlier group left a folder of that step: a folder is written once):

More: docs/design.md, "Notes from the code" (checkpoint/format.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from rayacc.engine.parallel import SHARDS_DIR
from rayacc.redact import redact

__all__ = [
    "FILES_KEY",
    "HISTORY_FILE",
    "META_FILE",
    "MODEL_FILE",
    "PARTS_KEY",
    "SHARDS_DIR",
    "STATE_FILE",
    "attempt_of",
    "checkpoint_meta",
    "file_entry",
    "folder_name",
    "part_files",
    "part_manifest",
    "sha256_of",
    "step_of",
    "write_checkpoint",
    "write_part",
]

STATE_FILE = "state.pt"
MODEL_FILE = "model.json"
HISTORY_FILE = "history.jsonl"
META_FILE = "meta.json"
FILES_KEY = "files"
"""A manifest's files: name → {"size", "sha256"} (a checkpoint of an earlier rayacc: name →
size, or none at all)."""
PARTS_KEY = "parts"
"""meta.json's list of the other ranks' part manifests (a sharded run's)."""
_NAME = re.compile(r"^checkpoint_step(\d+)(?:_attempt(\d+))?$")


def folder_name(step: int, attempt: int = 1) -> str:
    """The folder of the checkpoint of `step`; a later attempt at the same step (a group that
    resumed from before a checkpoint that did not become whole, or did not load) writes a
    folder of its own, `_attemptN`: a folder is written once, by one group, so nothing an
    earlier attempt or another world size left is read as part of it, and Ray Train's record
    of the run's checkpoints never names one folder for two."""
    return f"checkpoint_step{step:08d}" + (f"_attempt{attempt}" if attempt > 1 else "")


def step_of(name: str) -> int | None:
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def attempt_of(name: str) -> int:
    """The attempt a checkpoint folder's name says (1 for the plain name)."""
    m = _NAME.match(name)
    return int(m.group(2) or 1) if m else 0


def part_manifest(rank: int) -> str:
    """The manifest of rank `rank`'s part (rank 0's is meta.json)."""
    return META_FILE if rank == 0 else f"parts/rank_{rank:05d}.json"


def checkpoint_meta(
    identity, split, state, world: int, shards: str | None, state_format: str = "dcp"
) -> dict[str, Any]:
    """meta.json of a checkpoint written at `state` by a group of `world` ranks; `identity`:
    the run's (`quantities.run_identity`); `shards`: the folder every rank writes its part of
    the model and optimizer state into (None: rank 0 writes it whole into `state.pt`), in
    `state_format` (`dcp`: torch.distributed.checkpoint; `deepspeed`: DeepSpeed's own)."""
    sharded = shards is not None
    return {
        "optimizer_step": state.optimizer_step,
        "global_batch_size": split.global_batch_size,
        "grad_accum_steps": split.grad_accum_steps,
        # rows of a window per data-parallel rank: what the window ran with, not an input
        # to a resume (that re-derives the shares of its own size from the global batch)
        "shares": list(split.rank_shares),
        "num_workers": world,
        "epoch": state.epoch,
        "epoch_sample_offset": state.epoch_sample_offset,
        "identity": identity,
        "shards": shards,
        "state_format": state_format if sharded else "whole",
        PARTS_KEY: [part_manifest(r) for r in range(1, world)] if sharded else [],
    }


def sha256_of(path: Path) -> str:
    """A file's SHA-256, read once in 8 MiB pieces (a link is not followed)."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    """A file's manifest entry: its size and SHA-256."""
    return {"size": path.stat().st_size, "sha256": sha256_of(path)}


def _manifest(folder: Path, own: list[str]) -> dict[str, dict[str, Any]]:
    return {name: file_entry(folder / name) for name in sorted(own)}


def part_files(folder: Path, *, rank: int) -> list[str]:
    """The files of a rank's staging folder it lists (not its manifest, not a partial)."""
    names = []
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if not path.is_file() or name == part_manifest(rank) or name.endswith(".tmp"):
            continue
        names.append(name)
    return names


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_checkpoint(
    folder: str | Path,
    *,
    state: dict[str, Any],
    description: dict[str, Any],
    meta: dict[str, Any],
    files: dict[str, str] | None = None,
) -> Path:
    """Writes rank 0's part of a checkpoint into a local folder (its staging, or a folder made
    by hand): `state.pt`, `model.json`, `files` (more text files by name: a token run's
    vocabulary), and meta.json last, listing every file of the folder (a lineage copied in
    before included). Run twice, it writes the same part again."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, folder / STATE_FILE)
    # the config in a checkpoint is for rebuilding the model: its credentials stay out
    _atomic_write(folder / MODEL_FILE, json.dumps(redact(description)).encode())
    for name, text in (files or {}).items():
        _atomic_write(folder / name, text.encode())
    listed = {**meta, FILES_KEY: _manifest(folder, part_files(folder, rank=0))}
    listed.setdefault(PARTS_KEY, [])
    _atomic_write(folder / META_FILE, json.dumps(listed).encode())
    return folder


def write_part(folder: str | Path, *, rank: int, step: int) -> Path:
    """Writes the manifest of rank `rank`'s part (its shards, already in `folder`)."""
    folder = Path(folder)
    manifest = {
        "rank": rank,
        "optimizer_step": step,
        FILES_KEY: _manifest(folder, part_files(folder, rank=rank)),
    }
    _atomic_write(folder / part_manifest(rank), json.dumps(manifest).encode())
    return folder
