"""A fuzz test over every reader of a checkpoint: real checkpoints of each kind (a whole model
with its vocabulary, a sharded one), damaged at random per file, as storage and a hostile
file would (bytes flipped, cut short, extended, emptied, a link out of the folder, a folder,
JSON values of the wrong type, a pickle that runs code), half the time with the manifest
re-sealed to match (a crafted folder, so each file's own decoder meets the damage). Every
reader must end in the checkpoint error or load the very weights written; never another
exception, never code run, never a read of a file outside the folder."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch

from rayacc.checkpoint import CheckpointError, RunCheckpoints, load_model, read_checkpoint
from rayacc.checkpoint.format import META_FILE, folder_name
from rayacc.driver.sample import sample
from tests.support.data.strangers import Payload
from tests.support.data.tokens import gpt_checkpoint, token_data

CASES = 240
"""Seeded cases, half of each kind."""

_OPENED: list[str] = []
_WATCHING: list[bool] = [False]


def _audit(event: str, args) -> None:
    if _WATCHING[0] and event == "open" and isinstance(args[0], str | bytes | os.PathLike):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(kind → (run storage, checkpoint folder, weights)) of the two kinds."""
    root = tmp_path_factory.mktemp("fuzz")
    info = token_data(root, "chars")
    made = {}
    for kind in ("whole", "sharded"):
        storage = root / kind
        for step in (3, 6):
            folder = storage / "r" / folder_name(step)
            model = gpt_checkpoint(folder, info, sharded=kind == "sharded")
            lines = "".join(json.dumps({"step": s, "train/loss": 1.0}) + "\n" for s in range(1, 7))
            (folder / "history.jsonl").write_text(lines)
            _reseal(folder)
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        made[kind] = (storage, weights)
    return made


def _reseal(folder: Path) -> None:
    """meta.json made to list the folder's files as they are now (what a crafter does)."""
    meta = json.loads((folder / META_FILE).read_text())
    files = {}
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if name == META_FILE or (path.is_dir() and not path.is_symlink()):
            continue
        if path.is_symlink() or not path.is_file():
            files[name] = {"size": 0, "sha256": ""}
            continue
        data = path.read_bytes()
        files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    meta["files"] = files
    (folder / META_FILE).write_text(json.dumps(meta))


def _listed(folder: Path, name: str) -> bool:
    try:
        return name in json.loads((folder / META_FILE).read_text())["files"]
    except (ValueError, KeyError, TypeError, OSError):
        return True


def _wrong_types(data: bytes, rng: random.Random) -> bytes:
    try:
        value = json.loads(data)
    except ValueError:
        return data[::-1]
    junk = [None, "x", 7, -1, 2.5, [], {}, True, "../../etc/passwd", 10**30]
    if isinstance(value, dict) and value:
        key = rng.choice(sorted(value))
        value[key] = rng.choice(junk)
        if isinstance(value.get("files"), dict) and value["files"] and rng.random() < 0.5:
            name = rng.choice(sorted(value["files"]))
            value["files"][name] = rng.choice(junk)
    else:
        value = rng.choice(junk)
    return json.dumps(value).encode()


def _damage(path: Path, how: str, rng: random.Random, outside: Path, marker: Path) -> None:
    data = path.read_bytes() if path.is_file() else b""
    if how == "flip":
        buf = bytearray(data or b"\0")
        for _ in range(rng.randint(1, 8)):
            buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(buf))
    elif how == "truncate":
        path.write_bytes(data[: rng.randrange(max(1, len(data)))])
    elif how == "extend":
        path.write_bytes(data + os.urandom(rng.randint(1, 64)))
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "link":
        # a link to a copy of the file, outside the folder: a reader that follows it would
        # load it as if it were the checkpoint's
        shutil.copyfile(path, outside)
        path.unlink()
        path.symlink_to(outside)
    elif how == "folder":
        path.unlink()
        path.mkdir()
        (path / "inner").write_bytes(data)
    elif how == "json types":
        path.write_bytes(_wrong_types(data, rng))
    elif how == "code":
        path.write_bytes(pickle.dumps({"model": Payload(str(marker))}))


HOW = ["flip", "truncate", "extend", "empty", "link", "folder", "json types", "code"]


def _readers(storage: Path, folder: Path):
    def catalogue():
        run = RunCheckpoints(str(storage), "r")
        latest = run.latest()
        run.lineage(4)
        assert latest is not None and latest.step in (3, 6)
        return latest

    return {
        "read_checkpoint": lambda: read_checkpoint(folder),
        "load_model": lambda: load_model(folder),
        "sample": lambda: sample(str(folder), tokens=2),
        "catalogue": catalogue,
        "history": lambda: RunCheckpoints(str(storage), "r").list()[-1].history(),
    }


@pytest.mark.parametrize("kind", ["whole", "sharded"])
def test_every_reader_ends_in_the_checkpoint_error_or_the_weights_written(written, tmp_path, kind):
    original, weights = written[kind]
    found: dict[str, int] = {}
    for seed in range(CASES // 2):
        rng = random.Random(f"{kind}-{seed}")
        storage = tmp_path / f"case{seed}"
        shutil.copytree(original, storage, symlinks=True)
        folder = storage / "r" / folder_name(6)
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        target = rng.choice(files)
        how = rng.choice(HOW)
        outside, marker = tmp_path / f"outside{seed}", tmp_path / f"ran{seed}"
        _damage(target, how, rng, outside, marker)
        resealed = target.name != META_FILE and rng.random() < 0.5
        if resealed:
            _reseal(folder)
        # a folder the manifest no longer lists (re-sealed) is no part of the checkpoint
        listed = how != "folder" or _listed(folder, target.relative_to(folder).as_posix())
        # refused wherever the folder is read: a link or a folder it lists, code where a
        # pickle is read (elsewhere the payload is just bytes that are not JSON)
        refused = how in ("link", "folder") or (
            how == "code" and target.suffix in (".pt", ".distcp", ".metadata")
        )
        _OPENED.clear()
        _WATCHING[0] = True
        try:
            for name, read in _readers(storage, folder).items():
                try:
                    value = read()
                except CheckpointError:
                    found[f"{name}: refused"] = found.get(f"{name}: refused", 0) + 1
                    continue
                except Exception as exc:
                    raise AssertionError(
                        f"case {kind}-{seed}: {how} of {target.relative_to(folder)}: {name} "
                        f"raised {type(exc).__name__}: {exc}"
                    ) from exc
                # damage the manifest does not cover is caught; re-sealed, flipped numbers are a
                # checkpoint of other weights (data, loaded as such)
                if name == "load_model" and not resealed:
                    state = value.state_dict()
                    assert state.keys() == weights.keys()
                    for key, tensor in state.items():
                        assert torch.equal(tensor, weights[key]), (kind, seed, how, key)
                # what the reader reads: read_checkpoint leaves the shards' data to load_model
                whole_folder = (
                    name in ("load_model", "sample")
                    or (name == "read_checkpoint" and target.suffix != ".distcp")
                    or (name == "history" and target.name == "history.jsonl")
                )
                assert not (refused and whole_folder and listed), (
                    f"case {kind}-{seed}: {name} took a {how} in the folder"
                )
                if name == "catalogue" and how in ("link", "folder") and listed:
                    assert value.step == 3, f"case {kind}-{seed}: a {how} listed as whole"
                found[f"{name}: read"] = found.get(f"{name}: read", 0) + 1
        finally:
            _WATCHING[0] = False
        assert not marker.exists(), f"case {kind}-{seed}: a reader ran the checkpoint's code"
        assert str(outside) not in _OPENED, f"case {kind}-{seed}: read outside the folder"
        shutil.rmtree(storage)
    # the damage reached every reader both ways: some cases refused, some read
    for name in ("read_checkpoint", "load_model", "sample"):
        assert found.get(f"{name}: refused", 0) > 0, found
