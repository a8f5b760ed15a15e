"""Reading a checkpoint back is parsing untrusted input: a folder from shared storage or a
downloaded run may be damaged, cut short or crafted. Every reader here ends in a loaded value or
one `CheckpointError` naming the file and the fix: never another exception, never code run,
never a read outside the folder (a link or anything but a regular file is refused).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import stat
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rayacc.checkpoint.format import (
    FILES_KEY,
    HISTORY_FILE,
    META_FILE,
    MODEL_FILE,
    PARTS_KEY,
    STATE_FILE,
    sha256_of,
)
from rayacc.checkpoint.storage import NotAFile, Storage, open_storage

__all__ = [
    "CheckpointError",
    "load_model",
    "malformed_message",
    "manifests",
    "not_whole",
    "parse_json",
    "read_checkpoint",
    "read_file",
    "read_meta",
    "whole_problems",
]

EARLIER = (
    "Fix: use an earlier checkpoint_* folder of the run (or the run's previous checkpoint), "
    "or a checkpoint rayacc wrote"
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: names the file and the fix (exit 2 on the CLI)."""


def parse_json(text: str | bytes, source: str, *, lines: bool = False) -> Any:
    """A JSON file (`lines`: JSON Lines) a checkpoint or run folder holds, parsed; one that is
    truncated, not JSON or not of the shape rayacc writes is a CheckpointError naming it."""
    try:
        if lines:
            if isinstance(text, bytes):
                text = text.decode()
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        where = f" at line {exc.lineno}" if hasattr(exc, "lineno") else ""
        raise CheckpointError(
            f"{source} is not the JSON rayacc writes ({getattr(exc, 'msg', type(exc).__name__)}"
            f"{where}): the folder was damaged or written by something else. {EARLIER}"
        ) from None


def malformed_message(source: str, key: str) -> str:
    """What to say of a file rayacc wrote that lacks `key` where rayacc writes it."""
    return (
        f"{source} lacks `{key}` where rayacc writes it: the folder was damaged or written by "
        f"something else. {EARLIER}"
    )


def not_whole(location: str, missing: list[str]) -> str:
    """What is wrong with a folder whose files are not there as its manifests list them."""
    return (
        f"{location} is not a whole checkpoint: {', '.join(missing[:4])}"
        f"{' and more' if len(missing) > 4 else ''} — a copy cut short, or a file changed "
        "since it was written"
    )


# ----------------------------------------------------------------------------- manifests
def read_file(storage: Storage, name: str) -> bytes | None:
    try:
        return storage.read(name)
    except NotAFile as exc:
        raise CheckpointError(
            f"{exc.location} is a {exc.kind}, not a file rayacc writes: it is not followed "
            f"or read. {EARLIER}"
        ) from None
    except ValueError:
        raise CheckpointError(
            f"{storage.uri()} names {name!r}, outside its folder, so it is not read. {EARLIER}"
        ) from None


def read_meta(storage: Storage) -> dict[str, Any]:
    """meta.json of the checkpoint folder `storage`, with the keys every reader needs."""
    source = storage.uri(META_FILE)
    text = read_file(storage, META_FILE)
    if text is None:
        raise CheckpointError(
            f"{storage.uri()} is not a complete rayacc checkpoint (no {META_FILE}). Fix: pass "
            "the checkpoint_dir of a finished fit, or a checkpoint_* folder of the run"
        )
    meta = parse_json(text, source)
    if not isinstance(meta, dict) or type(meta.get("optimizer_step")) is not int:
        raise CheckpointError(malformed_message(source, "optimizer_step"))
    parts = meta.get(PARTS_KEY, [])
    if not isinstance(parts, list) or not all(isinstance(p, str) for p in parts):
        raise CheckpointError(malformed_message(source, PARTS_KEY))
    return meta


def _entries(files: Any, source: str) -> dict[str, tuple[int, str | None]]:
    """A manifest's files as name → (size, digest or None)."""
    if not isinstance(files, dict):
        raise CheckpointError(malformed_message(source, FILES_KEY))
    out = {}
    for name, entry in files.items():
        if type(entry) is int:  # an earlier rayacc's: the size alone
            out[name] = (entry, None)
        elif (
            isinstance(entry, dict)
            and type(entry.get("size")) is int
            and isinstance(entry.get("sha256"), str)
        ):
            out[name] = (entry["size"], entry["sha256"])
        else:
            raise CheckpointError(malformed_message(source, FILES_KEY))
    return out


def manifests(
    storage: Storage, meta: dict[str, Any]
) -> tuple[dict[str, tuple[int, str | None]], list[str]]:
    """Every file the checkpoint's manifests list (rank 0's in meta, the other ranks' parts)
    as name → (size, digest), and the parts whose manifests are not there."""
    files: dict[str, tuple[int, str | None]] = {}
    if FILES_KEY in meta:
        files.update(_entries(meta[FILES_KEY], storage.uri(META_FILE)))
    absent = []
    for part in meta.get(PARTS_KEY, []):
        text = read_file(storage, part)
        if text is None:
            absent.append(f"{part} (not there: that rank's part never arrived)")
            continue
        manifest = parse_json(text, storage.uri(part))
        if not isinstance(manifest, dict):
            raise CheckpointError(malformed_message(storage.uri(part), FILES_KEY))
        for name, entry in _entries(manifest.get(FILES_KEY), storage.uri(part)).items():
            files[name] = entry
    return files, absent


def whole_problems(storage: Storage, meta: dict[str, Any]) -> list[str]:
    """The files of the checkpoint `storage` its manifests list that are not there as listed,
    and whatever else the folder holds (a look at each, no read), each as `name (why)`; empty
    when whole. A manifest says what must be there and, by what it leaves out, what must not:
    a foreign library that reads the folder by its own rules (DeepSpeed's converter walks it
    for names it knows) never meets a file no manifest vouches for."""
    files, problems = manifests(storage, meta)
    for name, (size, _) in files.items():
        try:
            entry = storage.stat(name)
        except ValueError:
            problems.append(f"{name} (not inside the folder)")
            continue
        if entry is None:
            problems.append(f"{name} (not there)")
        elif entry.kind != "file":
            problems.append(f"{name} (a {entry.kind}, not a file)")
        elif entry.size != size:
            problems.append(f"{name} ({entry.size} of {size} bytes)")
    if FILES_KEY in meta:
        problems += unlisted(storage, {META_FILE, *meta.get(PARTS_KEY, []), *files})
    return problems


PASSED_OVER_FILE = "PASSED_OVER.json"
"""Written into a checkpoint folder whose load failed at a restore: a file no manifest lists,
so every reader passes the folder over from then on (the reason inside)."""


def unlisted(storage: Storage, listed: set[str], under: str = "") -> list[str]:
    """Everything in the folder `storage` (walked through the seam, links not followed) that is
    neither a name in `listed` nor a folder on the way to one, each as `name (why)`."""
    out = []
    for entry in storage.list(under):
        if entry.kind == "dir":
            out += unlisted(storage, listed, entry.name)
        elif entry.name not in listed:
            if entry.name == PASSED_OVER_FILE:
                why = _passed_over_reason(storage)
            elif entry.kind == "file":
                why = "not listed by any manifest: left by another attempt, or planted"
            else:
                why = f"a {entry.kind}, listed by no manifest"
            out.append(f"{entry.name} ({why})")
    return out


def _passed_over_reason(storage: Storage) -> str:
    try:
        said = json.loads(storage.read(PASSED_OVER_FILE) or b"{}").get("reason")
    except (ValueError, AttributeError, OSError):
        said = None
    return f"a restore could not load it: {str(said)[:300]}" if said else "a restore refused it"


def _no_links(folder: Path) -> None:
    """Refuses a folder holding a link or anything but folders and regular files."""
    if folder.is_symlink() or not folder.is_dir():
        raise CheckpointError(f"{folder} is not a checkpoint folder (a link, or not a folder)")
    for root, dirs, names in os.walk(folder, followlinks=False):
        for name in [*dirs, *names]:
            path = Path(root) / name
            mode = path.lstat().st_mode
            if stat.S_ISLNK(mode) or not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                kind = "link" if stat.S_ISLNK(mode) else "special file"
                raise CheckpointError(
                    f"{path} is a {kind}: a checkpoint holds regular files only, and a reader "
                    f"does not follow it out of the folder. {EARLIER}"
                )


def verify(folder: Path, into: Path | None = None) -> dict[str, Any]:
    """The meta of a local checkpoint folder that is whole, every file as its manifest lists
    it (size and digest) and nothing else in it; a CheckpointError naming what is not.

    `into`: the folder's *view* is laid there — meta.json, the parts' manifests and every file
    they list, each a second name for the checked file (a copy across disks), its digest
    checked there — and nothing else: what a foreign reader (DCP, DeepSpeed) is handed, never
    the checkpoint folder itself."""
    _no_links(folder)
    storage = open_storage(str(folder))
    meta = read_meta(storage)
    problems = whole_problems(storage, meta)
    if not problems and FILES_KEY not in meta and meta.get("shards"):
        problems.append(
            f"{META_FILE} (it lists no files: a sharded checkpoint's shards are handed to their "
            "reader only as a manifest lists them)"
        )
    if not problems:
        files, _ = manifests(storage, meta)
        names = dict.fromkeys([META_FILE, *meta.get(PARTS_KEY, [])], None)
        if FILES_KEY not in meta:  # an earlier rayacc's whole checkpoint: its known files
            names |= {n: None for n in _UNLISTED_KNOWN if (folder / n).is_file()}
        names |= {name: digest for name, (_, digest) in files.items()}
        for name, digest in names.items():
            checked = folder / name
            if into is not None:
                checked = _lay(folder / name, into / name)
            if digest is not None and sha256_of(checked) != digest:
                problems.append(f"{name} (its content changed: another SHA-256)")
    if problems:
        raise CheckpointError(f"{not_whole(str(folder), problems)}. {EARLIER}")
    return meta


_UNLISTED_KNOWN = (STATE_FILE, MODEL_FILE, HISTORY_FILE, "vocab.json")
"""The files of a whole checkpoint written before manifests listed them."""


def _lay(source: Path, target: Path) -> Path:
    """`target` as a second name for the regular file `source` (a copy where the disks differ),
    never following a link."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(source, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{source} is not a regular file, so it is not read. {EARLIER}")
        try:
            os.link(source, target, follow_symlinks=False)
        except OSError:
            with os.fdopen(os.dup(fd), "rb") as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out, 8 << 20)
    finally:
        os.close(fd)
    return target


# ----------------------------------------------------------------------------- one folder
def _section(folder: Path, name: str, keys: dict[str, type]) -> dict[str, Any]:
    """A JSON object file of a checkpoint holding `keys`, each a value of its type."""
    text = read_file(open_storage(str(folder)), name)
    if text is None:
        raise CheckpointError(
            f"{folder} lacks {name}: not a complete rayacc checkpoint. Fix: pass the "
            "checkpoint_dir of a finished fit, or a checkpoint_* folder of the run"
        )
    raw = parse_json(text, str(folder / name))
    for key, kind in keys.items():
        if not isinstance(raw, dict) or type(raw.get(key)) is not kind:
            raise CheckpointError(malformed_message(str(folder / name), key))
    return raw


def _load_state(path: Path, map_location) -> dict[str, Any]:
    try:
        # tensors, numbers, strings and plain containers only: a checkpoint from shared storage
        # or a downloaded run must not be able to run code here
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        if "global" in str(exc).lower():
            raise CheckpointError(
                f"{path} holds more than tensors and plain values, so it is not loaded (it "
                "could run code). rayacc checkpoints hold only tensors, numbers, strings and "
                "plain containers. Fix: load checkpoints written by rayacc; if you trust this "
                f"file, convert it to a plain state dict ({str(exc).splitlines()[0][:200]})"
            ) from None
        state = exc
    except Exception as exc:  # a damaged archive raises whatever its parser meets
        state = exc
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{path} is not a whole torch archive of a state ({type(state).__name__}): the "
            f"folder was damaged (a copy cut short?) or written by something else. {EARLIER}"
        )
    return state


def read_checkpoint(
    folder: str | Path, map_location: str | torch.device = "cpu", into: Path | None = None
) -> tuple[dict, dict, dict]:
    """(state, model description, meta) of a whole checkpoint folder on this machine, its
    strategy's files vetted for their reader (DCP's index, DeepSpeed's files read as data at
    the world size meta.json names). `into`: lay the checkpoint's view there (`verify`) and
    read from it; hand the view, never `folder`, to the strategy's loader."""
    folder = Path(folder)
    meta = verify(folder, into)
    if into is not None:
        folder = into
    state = _load_state(folder / STATE_FILE, map_location)
    description = _section(folder, MODEL_FILE, {"config": dict, "dataset": dict})
    vet_shards(folder, meta)
    return state, description, meta


def vet_shards(folder: Path, meta: dict[str, Any]) -> None:
    """A sharded checkpoint's files as their foreign reader will meet them: DCP's index read
    safely and every file it names there; DeepSpeed's files, every one read as data, exactly
    the ranks meta.json says wrote them. A CheckpointError naming what is not."""
    shards = shards_of(folder, meta)
    if shards is None:
        return
    if meta.get("state_format", "dcp") == "deepspeed":
        from rayacc.engine.zero_files import vet_zero_files

        world = meta.get("num_workers")
        if type(world) is not int or world < 1:
            raise CheckpointError(malformed_message(str(folder / META_FILE), "num_workers"))
        try:
            vet_zero_files(shards, world)
        except ValueError as exc:
            raise CheckpointError(f"{exc}. {EARLIER}") from None
        return
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


def shards_of(folder: str | Path, meta: dict[str, Any]) -> Path | None:
    """The folder of a sharded checkpoint's model and optimizer shards (inside the checkpoint
    folder, or refused); None when the model is whole in `state.pt`."""
    if not meta.get("shards"):
        return None
    from rayacc.engine.shards import ShardError, contained

    try:
        return contained(Path(folder), str(meta["shards"]), Path(folder) / META_FILE)
    except ShardError as exc:
        raise CheckpointError(str(exc)) from None


def described_model(
    path: str | Path,
    description: dict,
    factory: str | None,
    shapes: dict[str, tuple[int, ...]] | None = None,
) -> nn.Module:
    """The model a checkpoint's description builds (its initial weights). `shapes`: those of
    the weights the checkpoint holds; a built-in model is first built on the meta device and
    must have them, so a description of a huge model costs nothing before it is refused."""
    from pydantic import ValidationError

    from rayacc.config import TrainConfig
    from rayacc.data.sources import DatasetInfo
    from rayacc.models import build_model

    source = Path(path) / MODEL_FILE
    try:
        cfg = TrainConfig.model_validate(description["config"])
    except ValidationError as exc:
        raise CheckpointError(
            f"{source} holds no config rayacc can build a model from ({exc.error_count()} "
            f"problems, first at {'.'.join(map(str, exc.errors()[0]['loc']))}). {EARLIER}"
        ) from None
    if cfg.model.name == "hf":
        # the model is its config and the checkpoint's weights: a path a checkpoint names
        # (its config's file, its starting weights) is outside the folder, and never read
        if not isinstance(cfg.model.hf.config, dict):
            raise CheckpointError(
                f"{source} names its transformers config by a path, not the config itself "
                f"(rayacc writes the config). {EARLIER}"
            )
        hf = cfg.model.hf.model_copy(update={"weights": None})
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"hf": hf})})
    if cfg.model.name == "factory":
        if factory is None:
            raise CheckpointError(
                f"{path} holds a model made by model.factory={cfg.model.factory!r}; loading "
                "it would import and call code the checkpoint names, and a checkpoint is "
                "data. Fix: name the factory you trust: load_model(path, "
                "factory='package.module:function') or `rayacc sample ... --factory "
                "package.module:function`"
            )
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"factory": factory})})
    elif factory is not None:
        raise CheckpointError(
            f"{path} holds a built-in model (model.name={cfg.model.name}), not a factory's. "
            "Fix: load it without a factory"
        )
    try:
        info = DatasetInfo.from_dict(description["dataset"])
    except Exception as exc:  # any shape a crafted description takes
        raise CheckpointError(
            f"{source}'s dataset description is not one rayacc writes "
            f"({type(exc).__name__}). {EARLIER}"
        ) from None
    if factory is not None:
        return build_model(cfg, info)
    try:
        if shapes is not None:
            with torch.device("meta"):
                meta_model = build_model(cfg, info)
            described = {
                k: tuple(v.shape)
                for k, v in meta_model.state_dict().items()
                if isinstance(v, torch.Tensor)
            }
            if described != shapes:
                other = sorted(
                    k for k in described.keys() | shapes.keys() if described.get(k) != shapes.get(k)
                )
                raise CheckpointError(
                    f"{source} describes a model whose weights are not the ones the checkpoint "
                    f"holds ({', '.join(other[:3])}{' and more' if len(other) > 3 else ''}). "
                    f"{EARLIER}"
                )
        return build_model(cfg, info)
    except CheckpointError:
        raise
    except Exception as exc:  # a built-in model from a description no run could have had
        raise CheckpointError(
            f"{source} describes a model that cannot be built ({type(exc).__name__}: "
            f"{str(exc)[:200]}). {EARLIER}"
        ) from None


def _held_shapes(path, state: dict, shards: Path | None) -> dict[str, tuple[int, ...]]:
    """The shapes of the model weights a checkpoint holds: in state.pt, or in the shards'
    index (read safely)."""
    if shards is None:
        weights = state.get("model")
        if not isinstance(weights, dict):
            raise CheckpointError(malformed_message(str(Path(path) / STATE_FILE), "model"))
        return {k: tuple(v.shape) for k, v in weights.items() if isinstance(v, torch.Tensor)}
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from rayacc.engine.shards import ShardError, read_index

    try:
        index = read_index(shards)
    except ShardError as exc:
        raise CheckpointError(str(exc)) from None
    return {
        key.removeprefix("model."): tuple(entry.size)
        for key, entry in (index.state_dict_metadata or {}).items()
        if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
    }


def load_model(path: str | Path, factory: str | None = None) -> nn.Module:
    """The model saved in a checkpoint folder, with its weights, in eval mode, on the CPU.

    A checkpoint is data: it must not be able to run code here. A built-in model (`mlp`,
    `gpt`) is rebuilt from its description; a user factory's model only when the caller names
    the factory (`factory="package.module:function"`, which the caller trusts): the one the
    checkpoint names is never imported on its word. The factory is called with the
    checkpoint's `model.kwargs`."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rayacc-view-") as view:
        return _load_model(Path(path), Path(view), factory)


def _load_model(path: Path, view: Path, factory: str | None) -> nn.Module:
    state, description, meta = read_checkpoint(path, into=view)
    shards = shards_of(view, meta)
    zero = None
    if meta.get("state_format") == "deepspeed":
        from rayacc.engine.zero_files import read_zero_weights

        try:
            # DeepSpeed's files read as data, its runtime neither started nor imported
            zero = read_zero_weights(shards, meta["num_workers"])
        except ValueError as exc:
            raise CheckpointError(f"{exc}. {EARLIER}") from None
        held = {k: tuple(v.shape) for k, v in zero.items()}
    else:
        held = _held_shapes(path, state, shards)
    model = described_model(path, description, factory, held)
    try:
        if zero is not None:
            model.load_state_dict(zero)
        elif shards is None:
            if not isinstance(state.get("model"), dict):
                raise CheckpointError(malformed_message(str(Path(path) / STATE_FILE), "model"))
            model.load_state_dict(state["model"])
        else:
            from rayacc.engine.shards import load_model_shards

            load_model_shards(shards, model)
    except CheckpointError:
        raise
    except Exception as exc:  # weights of another shape, a shard that decodes to nonsense
        from rayacc.engine.shards import ShardError

        if isinstance(exc, ShardError):
            raise CheckpointError(str(exc)) from None
        raise CheckpointError(
            f"{path}'s weights do not fit the model its {MODEL_FILE} describes "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}). {EARLIER}"
        ) from None
    return model.eval()
