"""What a checkpoint folder's manifests say, and whether the folder is what they say: meta.json
and the parts' manifests read and checked, the files they list looked at, anything else in the
folder named a stranger, and the folder's *view* (its manifests' files only, each checked) laid
for a reader. The first gate of reading a checkpoint back (`reader` loads what passes), and the
one error every reader ends in (`CheckpointError`)."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

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
    "EARLIER",
    "PASSED_OVER_FILE",
    "CheckpointError",
    "malformed_message",
    "manifests",
    "not_whole",
    "parse_json",
    "read_file",
    "read_meta",
    "unlisted",
    "verify",
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
