"""A run's checkpoints, in one place: what a checkpoint holds, its folder's name, writing,
validation, listing, the latest one, and a worker's save and restore.

A checkpoint is the folder `checkpoint_step{step:08d}` in the run's folder `storage/name`:

- `state.pt`: the model and optimizer state (whole), the schedule, scaler and train state, and
  every rank's random state; a sharded (FSDP) run keeps model and optimizer as every rank's
  shards under `shards/` (engine/shards.py) instead;
- `model.json`: the config and dataset description (`load_model` rebuilds the model from it);
- `history.jsonl`: the run's lineage, every step record from step 1 to this step, one JSON
  object a line (about 600 bytes a step): the record a resume replays into MLflow, and the whole
  run's loss curve;
- `meta.json`, written last: the step, the batch split and worker count it was written at, the
  epoch position, the run's identity (what a resume must match), whether it is sharded, and
  every other file rank 0 wrote with its size (`files`).

A folder without `meta.json` (a crash mid-write) is never listed or loaded; Ray Train registers a
reported checkpoint only after every rank's part has been copied whole, so the previous one
stays the latest. A copy into storage cut short (a node lost mid-upload) can leave `meta.json`
without the rest: a folder where a file `files` lists is missing or of another size is not
loaded, and the run's latest checkpoint and lineage pass over it and say so. A folder whose
shard index names a file that is not there (another rank's part) is refused.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rayacc.config import TrainConfig
from rayacc.data.reads import filesystem_and_path, read_bytes
from rayacc.data.sources import DatasetInfo
from rayacc.engine.strategy import SHARDS_DIR
from rayacc.redact import redact

__all__ = [
    "FILES_KEY",
    "HISTORY_FILE",
    "META_FILE",
    "SHARDS_DIR",
    "Checkpoint",
    "CheckpointError",
    "RunCheckpoints",
    "StepLog",
    "WorkerParts",
    "load_model",
    "malformed_message",
    "parse_json",
    "read_checkpoint",
    "write_checkpoint",
]

STATE_FILE = "state.pt"
MODEL_FILE = "model.json"
HISTORY_FILE = "history.jsonl"
FILES_KEY = "files"
"""meta.json's list of every other file of the folder (rank 0's part) and its size."""
META_FILE = "meta.json"
_NAME = re.compile(r"^checkpoint_step(\d+)$")


def parse_json(text: str | bytes, source: str, *, lines: bool = False) -> Any:
    """A JSON file (`lines`: JSON Lines) a checkpoint or run folder holds, parsed; one that is
    truncated, not JSON or not of the shape rayacc writes is a CheckpointError naming it (exit
    2), never a traceback."""
    try:
        if lines:
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{source} is not the JSON rayacc writes ({exc.msg if hasattr(exc, 'msg') else exc}"
            f"{f' at line {exc.lineno}' if hasattr(exc, 'lineno') else ''}): the folder was "
            "damaged or written by something else. Fix: use an earlier checkpoint_* folder "
            "of the run (or the run's previous checkpoint), or a checkpoint rayacc wrote"
        ) from None


class CheckpointError(ValueError):
    pass


# ----------------------------------------------------------------------------- identity
def checkpoint_meta(identity, split, state, world: int, sharded: bool) -> dict[str, Any]:
    """meta.json of a checkpoint written at `state` by a group of `world` ranks; `identity`:
    the run's (`quantities.run_identity`)."""
    return {
        "optimizer_step": state.optimizer_step,
        "global_batch_size": split.global_batch_size,
        "grad_accum_steps": split.grad_accum_steps,
        "num_workers": world,
        "epoch": state.epoch,
        "epoch_sample_offset": state.epoch_sample_offset,
        "identity": identity,
        "shards": SHARDS_DIR if sharded else None,
    }


# ----------------------------------------------------------------------------- one folder
def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_checkpoint(
    folder: str | Path,
    *,
    state: dict[str, Any],
    description: dict[str, Any],
    meta: dict[str, Any],
    history: StepLog | None = None,
    files: dict[str, str] | None = None,
) -> Path:
    """Writes a checkpoint folder; `meta.json` last, so a folder that has it is whole. `files`:
    more text files by name (a token run's vocabulary)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, folder / STATE_FILE)
    # the config in a checkpoint is for rebuilding the model: its credentials stay out
    _atomic_write_text(folder / MODEL_FILE, json.dumps(redact(description)))
    if history is not None:
        history.copy_to(folder / HISTORY_FILE)
    for name, text in (files or {}).items():
        _atomic_write_text(folder / name, text)
    # what a whole copy of the folder holds: a copy into storage cut short (a node lost
    # mid-upload) may have meta.json and not the rest, or part of it
    manifest = {
        path.relative_to(folder).as_posix(): path.stat().st_size
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name != META_FILE and not path.name.endswith(".tmp")
    }
    _atomic_write_text(folder / META_FILE, json.dumps({**meta, FILES_KEY: manifest}))
    return folder


def missing_files(location: str, meta: dict[str, Any]) -> list[str]:
    """The files `meta` lists that are not whole at the checkpoint `location` (a local path
    or a URI), each as `name (why)`; none for a checkpoint written before meta listed them."""
    from pyarrow import fs

    files = meta.get(FILES_KEY)
    if files is None:
        return []
    if not isinstance(files, dict) or not all(type(n) is int for n in files.values()):
        raise CheckpointError(malformed_message(f"{location}/{META_FILE}", FILES_KEY))
    filesystem, root = filesystem_and_path(location)
    inside = [n for n in files if not n.startswith("/") and ".." not in n.split("/")]
    infos = filesystem.get_file_info([f"{root}/{n}" for n in inside])
    missing = [f"{n} (not inside the folder)" for n in files if n not in inside]
    for name, info in zip(inside, infos, strict=True):
        if info.type != fs.FileType.File:
            missing.append(f"{name} (not there)")
        elif info.size != files[name]:
            missing.append(f"{name} ({info.size} of {files[name]} bytes)")
    return missing


def not_whole(location: str, missing: list[str]) -> str:
    """What is wrong with a folder `missing_files` found files missing or short in."""
    return (
        f"{location} is not a whole checkpoint: {', '.join(missing[:4])}"
        f"{' and more' if len(missing) > 4 else ''} — a copy cut short, or a file changed "
        "since it was written"
    )


def malformed_message(source: str, key: str) -> str:
    """What to say of a file rayacc wrote that lacks `key` where rayacc writes it."""
    return (
        f"{source} lacks `{key}` where rayacc writes it: the folder was damaged or written by "
        "something else. Fix: use an earlier checkpoint_* folder of the run, or a checkpoint "
        "rayacc wrote"
    )


def _section(path: Path, keys: dict[str, type]) -> dict[str, Any]:
    """A JSON object file of a checkpoint holding `keys`, each a value of its type."""
    if not path.is_file():
        raise CheckpointError(
            f"{path.parent} lacks {path.name}: not a complete rayacc checkpoint. Fix: pass the "
            "checkpoint_dir of a finished fit, or a checkpoint_* folder of the run"
        )
    raw = parse_json(path.read_bytes(), str(path))
    for key, kind in keys.items():
        if not isinstance(raw, dict) or type(raw.get(key)) is not kind:
            raise CheckpointError(malformed_message(str(path), key))
    return raw


def read_checkpoint(
    folder: str | Path, map_location: str | torch.device = "cpu"
) -> tuple[dict, dict, dict]:
    """(state, model description, meta) of a complete checkpoint folder on this machine."""
    folder = Path(folder)
    if not (folder / META_FILE).is_file():
        raise CheckpointError(
            f"{folder} is not a complete rayacc checkpoint (no {META_FILE}). Fix: pass the "
            "checkpoint_dir of a finished fit, or a checkpoint_* folder of the run"
        )
    meta = _section(folder / META_FILE, {"optimizer_step": int})
    missing = missing_files(str(folder), meta)
    if missing:
        raise CheckpointError(
            f"{not_whole(str(folder), missing)}. Fix: use an earlier checkpoint_* folder of the run"
        )
    try:
        # tensors, numbers, strings and plain containers only: a checkpoint from shared storage
        # or a downloaded run must not be able to run code here
        state = torch.load(folder / STATE_FILE, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
        # torch's restricted unpickler refuses a global (a class, a function: code), or the
        # file is no whole archive (cut short, empty, not torch's): damaged, not dangerous
        if "global" not in str(exc).lower():
            raise CheckpointError(
                f"{folder / STATE_FILE} is not a whole torch archive ({type(exc).__name__}): "
                "the folder was damaged (a copy cut short?) or written by something else. Fix: "
                "use an earlier checkpoint_* folder of the run, or a checkpoint rayacc wrote"
            ) from None
        raise CheckpointError(
            f"{folder / STATE_FILE} holds more than tensors and plain values, so it is not "
            "loaded (it could run code). rayacc checkpoints hold only tensors, numbers, strings "
            "and plain containers. Fix: load checkpoints written by rayacc; if you trust this "
            f"file, convert it to a plain state dict ({str(exc).splitlines()[0][:200]})"
        ) from None
    description = _section(folder / MODEL_FILE, {"config": dict, "dataset": dict})
    shards = _shards_of(folder, meta)
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


def _shards_of(folder: str | Path, meta: dict[str, Any]) -> Path | None:
    """The folder of a sharded checkpoint's model and optimizer shards (inside the checkpoint
    folder, or refused); None when the model is whole in `state.pt`."""
    if not meta.get("shards"):
        return None
    from rayacc.engine.shards import ShardError, contained

    try:
        return contained(Path(folder), str(meta["shards"]), Path(folder) / META_FILE)
    except ShardError as exc:
        raise CheckpointError(str(exc)) from None


def load_model(path: str | Path, factory: str | None = None) -> nn.Module:
    """The model saved in a checkpoint folder, with its weights, in eval mode, on the CPU.

    A checkpoint is data: it must not be able to run code here. A built-in model (`mlp`,
    `gpt`) is rebuilt from its description; a user factory's model only when the caller names
    the factory (`factory="package.module:function"`, which the caller trusts): the one the
    checkpoint names is never imported on its word. The factory is called with the
    checkpoint's `model.kwargs`."""
    from rayacc.models import build_model

    state, description, meta = read_checkpoint(path)
    cfg = TrainConfig.model_validate(description["config"])
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
    model = build_model(cfg, DatasetInfo.from_dict(description["dataset"]))
    shards = _shards_of(path, meta)
    if shards is None:
        model.load_state_dict(state["model"])
    else:
        from rayacc.engine.shards import load_model_shards

        load_model_shards(shards, model)
    return model.eval()


# ----------------------------------------------------------------------------- a run's folders
@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint of a run, on any storage pyarrow reaches."""

    uri: str
    step: int

    def meta(self) -> dict[str, Any]:
        text = read_bytes(f"{self.uri}/{META_FILE}")
        if text is None:
            raise CheckpointError(f"{self.uri} lost its {META_FILE} (deleted meanwhile?)")
        meta = parse_json(text, f"{self.uri}/{META_FILE}")
        if not isinstance(meta, dict) or not isinstance(meta.get("optimizer_step"), int):
            raise CheckpointError(malformed_message(f"{self.uri}/{META_FILE}", "optimizer_step"))
        return meta

    def missing(self) -> list[str]:
        """The files of the folder its meta.json lists that are not whole in storage."""
        return missing_files(self.uri, self.meta())

    def history(self, through: int | None = None) -> list[dict[str, Any]]:
        """The lineage's step records up to this checkpoint's step (or `through`), in order;
        empty for a checkpoint written before checkpoints carried it."""
        text = read_bytes(f"{self.uri}/{HISTORY_FILE}") or b""
        source = f"{self.uri}/{HISTORY_FILE}"
        records = parse_json(text, source, lines=True)
        if not all(isinstance(r, dict) and isinstance(r.get("step"), int) for r in records):
            raise CheckpointError(malformed_message(source, "step"))
        last = self.step if through is None else min(through, self.step)
        return [r for r in records if r["step"] <= last]


class RunCheckpoints:
    """The checkpoints of the run `storage/name`: their folder names, the complete ones in step
    order, the latest. In a worker (`parts` given) it also saves and restores them."""

    def __init__(self, storage: str, name: str, parts: WorkerParts | None = None):
        self.storage, self.name, self.parts = storage, name, parts
        self._in_flight: _InFlight | None = None
        self.skipped: list[str] = []
        """Checkpoints `latest` or `lineage` passed over, not whole, each said once."""
        self.complete_s: float | None = None
        """The seconds the latest complete checkpoint took, from the save to its files in
        storage (what a checkpoint the ranks must wait for costs)."""

    @staticmethod
    def folder_name(step: int) -> str:
        return f"checkpoint_step{step:08d}"

    @staticmethod
    def step_of(folder_name: str) -> int | None:
        m = _NAME.match(folder_name)
        return int(m.group(1)) if m else None

    def list(self) -> list[Checkpoint]:
        """The run's checkpoints with `meta.json`, oldest first. Whether every file it lists
        arrived whole is `Checkpoint.missing` (one read and a look at each file):
        `latest` and `lineage` ask it of the ones they take, newest first."""
        from pyarrow import fs

        filesystem, root = filesystem_and_path(self.storage)
        folder = f"{root}/{self.name}"
        infos = filesystem.get_file_info(fs.FileSelector(folder, allow_not_found=True))
        found = []
        for info in infos:
            step = self.step_of(info.base_name)
            if info.type != fs.FileType.Directory or step is None:
                continue
            meta = filesystem.get_file_info(f"{info.path}/{META_FILE}")
            if meta.type == fs.FileType.File:
                found.append(Checkpoint(f"{self._uri_root()}/{info.base_name}", step))
        return sorted(found, key=lambda c: c.step)

    def _uri_root(self) -> str:
        return f"{self.storage.rstrip('/')}/{self.name}"

    def latest(self) -> Checkpoint | None:
        """The newest whole checkpoint; a newer one whose copy was cut short is passed over
        and said in `skipped`."""
        return self._first_whole(reversed(self.list()))

    def lineage(self, step: int) -> list[dict[str, Any]]:
        """The step records 1..`step` of the run's lineage: from the checkpoint at `step`, or
        a later one of the same lineage when that one was pruned meanwhile (or is not
        whole)."""
        if step <= 0:
            return []
        found = self._first_whole(c for c in self.list() if c.step >= step)
        return found.history(through=step) if found else []

    def _first_whole(self, checkpoints) -> Checkpoint | None:
        for checkpoint in checkpoints:
            missing = checkpoint.missing()
            if not missing:
                return checkpoint
            note = not_whole(checkpoint.uri, missing)
            if note not in self.skipped:
                self.skipped.append(note)
        return None

    # ------------------------------------------------------------------ in a worker
    def restore(self) -> dict[str, Any] | None:
        """Loads the run's latest checkpoint (Ray Train's), if any, into the worker's parts
        and returns its meta."""
        import ray.train

        w = self._worker()
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return None
        with checkpoint.as_directory() as folder:
            saved, _, meta = read_checkpoint(folder, map_location=w.device)
            w.strategy.load(w.optimizer, folder, saved)
            if w.history is not None:
                w.history.load(Path(folder) / HISTORY_FILE)
        for name, part in w.stateful.items():
            if part is not None and saved.get(name) is not None:
                part.load_state_dict(saved[name])
        w.restore_rng(saved.get("rng"), meta["optimizer_step"])
        return meta

    def save(
        self,
        metrics: dict[str, Any],
        *,
        step: int,
        description: dict,
        meta: dict,
        files: dict[str, str] | None = None,
        background: bool = False,
    ) -> None:
        """Every rank reports (a barrier). Rank 0 writes the folder, with every rank's random
        state and the lineage; a strategy that shards has every rank write its part first (Ray
        Train merges the parts into one checkpoint folder in the run's storage).

        `background`: training waits only for the copy of the state (and, sharded, its
        staging); the files are written and copied into storage on Ray Train's upload thread,
        and Ray Train registers the checkpoint (the one a restart resumes from) only once that
        is done. At most one is in flight: a save first waits for the one before (`wait`)."""
        import ray.train

        from rayacc.engine import all_gather_objects
        from rayacc.engine.strategy import host_copy

        self.wait()
        w = self._worker()
        started = time.perf_counter()
        rng = all_gather_objects(w.rng_state())
        folder = Path(tempfile.mkdtemp(prefix="rayacc-checkpoint-"))
        try:
            whole, written = w.strategy.save(w.optimizer, folder, w.rank, background=background)
            state = None
            if w.rank == 0:
                parts = {n: None if p is None else p.state_dict() for n, p in w.stateful.items()}
                state = {**whole, **(host_copy(parts) if background else parts), "rng": rng}
                if w.history is not None:
                    w.history.copy_to(folder / HISTORY_FILE)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise

        def write() -> None:
            written()
            if state is not None:
                write_checkpoint(
                    folder, state=state, description=description, meta=meta, files=files
                )

        has_part = w.rank == 0 or w.strategy.writes_shards
        checkpoint = ray.train.Checkpoint.from_directory(folder) if has_part else None
        name = self.folder_name(step)
        if not background or checkpoint is None:
            try:
                write()
                ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            self.complete_s = time.perf_counter() - started
            return
        storage = ray.train.get_context().get_storage()
        flight = _InFlight(step)

        def write_then_upload(ckpt: ray.train.Checkpoint, dir_name: str) -> ray.train.Checkpoint:
            try:
                write()
                return storage.persist_current_checkpoint(ckpt, dir_name)
            except BaseException as exc:
                flight.error = exc
                shutil.rmtree(folder, ignore_errors=True)
                raise
            finally:
                flight.seconds = time.perf_counter() - started
                flight.done.set()

        self._in_flight = flight
        ray.train.report(
            metrics,
            checkpoint=checkpoint,
            checkpoint_dir_name=name,
            checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
            checkpoint_upload_fn=write_then_upload,
            delete_local_checkpoint_after_upload=True,
        )

    def wait(self) -> None:
        """Until the checkpoint in flight, if any, is in storage (its time: `complete_s`); one
        that could not be written ends the group (a restart resumes from the one before)."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        flight.done.wait()
        self.complete_s = flight.seconds
        if flight.error is not None:
            raise RuntimeError(
                f"the checkpoint of step {flight.step} could not be written "
                f"({type(flight.error).__name__}: {redact(str(flight.error))[:300]})"
            ) from flight.error

    def _worker(self) -> WorkerParts:
        if self.parts is None:
            raise RuntimeError("RunCheckpoints saves and restores only in a worker (parts=)")
        return self.parts


@dataclass
class _InFlight:
    """A checkpoint being written and copied into storage in the background."""

    step: int
    done: threading.Event = field(default_factory=threading.Event)
    seconds: float = 0.0
    error: BaseException | None = None


class StepLog:
    """Rank 0's copy of the run's lineage: every step record so far, spooled to a local file
    (a long run's records stay off the heap; about 600 bytes and 25 µs a step); a checkpoint
    takes a copy. The file has no name (an anonymous temporary file): nothing is left in the
    temp folder however the process ends, a group ended by a resize or a failure included."""

    def __init__(self) -> None:
        # open for the run's length
        self._file = tempfile.TemporaryFile("w+", prefix="rayacc-history-")  # noqa: SIM115

    def append(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, default=str) + "\n")

    def load(self, path: Path) -> None:
        """Starts from a checkpoint's lineage (none: an empty one)."""
        self._file.seek(0)
        self._file.truncate()
        if path.is_file():
            with open(path) as saved:
                shutil.copyfileobj(saved, self._file)

    def copy_to(self, path: Path) -> None:
        self._file.flush()
        self._file.seek(0)
        with open(path, "w") as copy:
            shutil.copyfileobj(self._file, copy)
        self._file.seek(0, os.SEEK_END)


@dataclass
class WorkerParts:
    """What a worker's checkpoint saves and restores: the strategy's model and optimizer state
    (whole, or every rank's shards), the `stateful` parts by name (schedule, scaler, train
    state: anything with `state_dict` / `load_state_dict`), every rank's random state, and on
    rank 0 the lineage (`history`)."""

    strategy: Any
    optimizer: torch.optim.Optimizer
    stateful: dict[str, Any]
    rank: int
    world: int
    device: torch.device
    seed: int
    history: StepLog | None = None

    def rng_state(self) -> dict[str, torch.Tensor | None]:
        cuda = self.device.type == "cuda"
        return {
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(self.device) if cuda else None,
        }

    def restore_rng(self, saved: list[dict[str, torch.Tensor | None]] | None, step: int) -> None:
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
