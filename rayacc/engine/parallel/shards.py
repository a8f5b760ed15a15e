"""Sharded checkpoints of a sharded model (`torch.distributed.checkpoint`, DCP): every rank writes
the shards it holds of the model and optimizer state, rank 0 also the index (`.metadata`); a
later run loads them at any number of ranks (DCP reads each rank's rows from whichever files
hold them), and one process can load the whole model for inference.

Loading never unpickles code. DCP reads its index with plain `pickle` and non-tensor values
(an optimizer's hyperparameters) with `torch.load(weights_only=False)`; here the index goes
through an unpickler that knows only DCP's own metadata classes, and values through
`weights_only=True`. A file that needs anything else is refused with a `ShardError`.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from rayacc.engine.units import frozen_names, load_weights, unwrap, without_frozen

__all__ = [
    "INDEX_FILE",
    "ShardError",
    "contained",
    "load_model_shards",
    "load_sharded",
    "missing_shard_files",
    "read_index",
    "save_sharded",
]

INDEX_FILE = ".metadata"
"""DCP's index of which file holds which rows of which tensor (written by the coordinator)."""


class ShardError(ValueError):
    """A sharded checkpoint that cannot be loaded: names the file and the fix."""


# the classes a DCP index is made of (torch 2.x): anything else in the file is refused
_INDEX_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _Refused(pickle.UnpicklingError):
    """The index names a global that no checkpoint index holds (code, not data)."""


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _INDEX_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        value = getattr(torch, name, None) if module == "torch" else None
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
            return value
        raise _Refused(f"{module}.{name} is not part of a checkpoint index")


class _SafeReader(FileSystemReader):
    """DCP's file reader with the index read by `_IndexUnpickler`."""

    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / INDEX_FILE
        from torch.distributed.checkpoint.metadata import Metadata

        try:
            data = path.read_bytes()
            _bounded(data)
            metadata = _IndexUnpickler(io.BytesIO(data)).load()
        except _Refused as exc:
            raise ShardError(
                f"{path} holds more than a checkpoint index, so it is not loaded (it could run "
                f"code): {exc}. Fix: load checkpoints written by rayacc"
            ) from None
        except Exception as exc:  # unpickling damaged bytes raises any kind of error
            metadata = exc
        if not isinstance(metadata, Metadata):
            raise ShardError(
                f"{path} is not a checkpoint index ({type(metadata).__name__}): the folder was "
                "damaged (a copy cut short?) or written by something else. Fix: use an earlier "
                "checkpoint_* folder of the run, or a checkpoint rayacc wrote"
            )
        for info in (metadata.storage_data or {}).values():
            contained(Path(self.path), info.relative_path, path)
        metadata.storage_meta = getattr(metadata, "storage_meta", None) or _storage_meta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _bounded(data: bytes) -> None:
    """Refuses (ValueError) a pickle whose numbers would make the unpickler allocate more than
    the data could hold: a length past the end, a memo slot past the number of opcodes (the
    unpickler grows its memo to the slot: a damaged `LONG_BINPUT` asked 24 GB, seen)."""
    for ops, (op, arg, pos) in enumerate(pickletools.genops(data), 1):
        if op.name in ("BINPUT", "LONG_BINPUT", "PUT", "BINGET", "LONG_BINGET", "GET"):
            if int(arg) > ops:
                raise ValueError(f"memo slot {arg} at byte {pos}")
        elif op.name == "FRAME" and int(arg) > len(data) - pos:
            raise ValueError(f"a frame of {arg} bytes at byte {pos}")


def contained(folder: Path, relative: str, named_in: Path | str) -> Path:
    """`folder / relative`, refused (ShardError) unless it stays inside `folder`: an index or a
    meta.json that names `../x` or `/etc/x` would make the loader read files anywhere."""
    target = (folder / relative).resolve()
    if Path(relative).is_absolute() or not target.is_relative_to(folder.resolve()):
        raise ShardError(
            f"{named_in} names {relative!r}, outside the checkpoint folder {folder}, so it is not "
            "loaded. Fix: load checkpoints written by rayacc (their files are inside their folder)"
        )
    return target


def _storage_meta():
    from torch.distributed.checkpoint.metadata import StorageMeta

    return StorageMeta()


class _SafePlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor values read as plain data only."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise ShardError(
                f"a value of {read_item.dest_index.fqn} holds more than plain data, so it is "
                f"not loaded (it could run code): {str(exc).splitlines()[0][:200]}"
            ) from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def save_sharded(
    folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, *, group=None
) -> Future | None:
    """Every rank writes its shards of the model and optimizer state into `folder` (its own
    `__<rank>_0.distcp`; rank 0 also the index): a collective, every rank calls it. The folders
    may be different ones per rank (each rank's part is then merged into one).

    `group` (a host-side gloo group of every rank, not the training one): the shards are
    copied to host memory now and written in the background, DCP's collectives on that
    group; returns the future of the write."""
    from torch.distributed.checkpoint import async_save, save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer, options=_options(model))
    model_state = without_frozen(model, model_state)
    state = _chunked({"model": model_state, "optimizer": optimizer_state})
    writer = FileSystemWriter(os.fspath(folder), single_file_per_rank=True)
    if group is None:
        save(state, storage_writer=writer)
        return None
    return async_save(state, storage_writer=writer, process_group=group)


def load_sharded(folder: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Loads a `save_sharded` folder into a sharded model and its optimizer at this run's
    number of ranks (a collective)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    options = _options(model)
    # what is asked for is what must be there: DCP's read refuses a checkpoint without it
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    placed = {"model": without_frozen(model, model_state), "optimizer": optimizer_state}
    state = _chunked(placed)
    renamed = _tied_aliases(state["optimizer"].get("state", {}), model, folder)
    _load(state, folder)
    for later, first in renamed:  # back under this rank's own name
        state["optimizer"]["state"][later] = state["optimizer"]["state"].pop(first)
    # the groups' settings are one rank's (a pipeline's stages hold other parameters under
    # the same settings): each rank keeps its own groups' parameter names
    loaded, own = state["optimizer"].get("param_groups"), optimizer_state.get("param_groups")
    if loaded and own and len(loaded) == len(own):
        for group, mine in zip(loaded, own, strict=True):
            group["params"] = mine["params"]
    # each value back in its parameter's layout: a moment left whole on the tensor-parallel
    # dimension beside a split parameter is stepped as a copy by the fused kernels, and lost
    state = _placed_as(state, placed)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=options,
    )


def _tied_aliases(optimizer_state: dict, model: nn.Module, folder) -> list[tuple[str, str]]:
    """A tied weight's later copy (a pipeline's last stage holds the head its first stage's
    embedding is tied to) asks for its optimizer state under the first name where the
    checkpoint has only that one (a run without a pipeline keeps a tied weight once); the
    (later, first) names so asked."""
    ties = getattr(unwrap(model), "pipeline_tied", dict)()
    wanted = [(later, first) for later, first in ties.items()
              if later in optimizer_state and first not in optimizer_state]  # fmt: skip
    if not wanted:
        return []
    saved = set(read_index(folder).state_dict_metadata or {})
    renamed = []
    for later, first in wanted:
        if not any(k.startswith(f"optimizer.state.{later}.") for k in saved):
            optimizer_state[first] = optimizer_state.pop(later)
            renamed.append((later, first))
    return renamed


def _options(model: nn.Module):
    """A model with frozen parameters (adapters on a base): its state leaves them out (and
    `without_frozen` a tied one's other names, which DCP's option keeps)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if not frozen_names(model):
        return None
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def _chunked(state: Any) -> Any:
    """The state with each tensor split part by part over a mesh dimension (a tensor-parallel
    fused weight: `_StridedShard`, whose rows DCP's index cannot name as one chunk) held whole
    on that dimension instead: what is written is plain row or column chunks, readable at any
    mesh; loading back cuts each rank's part again (a local slice)."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(state, dict):
        return {k: _chunked(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_chunked(v) for v in state]
    if isinstance(state, DTensor) and any(isinstance(p, _StridedShard) for p in state.placements):
        whole = [Replicate() if isinstance(p, _StridedShard) else p for p in state.placements]
        return state.redistribute(state.device_mesh, whole)
    return state


def _placed_as(loaded: Any, placed: Any) -> Any:
    """`loaded` (what `_chunked` made of `placed`, read back) with each DTensor redistributed
    to the placements of its counterpart in `placed`: the layout the run steps it in."""
    from torch.distributed.tensor import DTensor

    if isinstance(loaded, dict):
        return {k: _placed_as(v, placed.get(k) if isinstance(placed, dict) else None)
                for k, v in loaded.items()}  # fmt: skip
    if isinstance(loaded, list):
        others = placed if isinstance(placed, list) else [None] * len(loaded)
        return [_placed_as(v, p) for v, p in zip(loaded, others, strict=True)]
    if (
        isinstance(loaded, DTensor)
        and isinstance(placed, DTensor)
        and tuple(loaded.placements) != tuple(placed.placements)
    ):
        return loaded.redistribute(placed.device_mesh, placed.placements)
    return loaded


@torch.no_grad()
def load_model_shards(folder: str | Path, model: nn.Module) -> None:
    """Loads the model part of a `save_sharded` folder whole into an unsharded model, in this
    process alone (no process group): for inference."""
    state = {"model": without_frozen(model, model.state_dict())}
    _load(state, folder, no_dist=True)
    load_weights(model, state["model"])


def _load(state: dict, folder: str | Path, no_dist: bool = False) -> None:
    """DCP's load through the safe reader and planner; a refusal surfaces as the ShardError
    (DCP wraps every rank's failure in one CheckpointException)."""
    import warnings

    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            # the one-process load is what no_dist asks for, not a surprise to warn of
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            load(
                state,
                storage_reader=_SafeReader(os.fspath(folder)),
                planner=_SafePlanner(),
                no_dist=no_dist,
            )
    except CheckpointException as exc:  # a BaseException: every rank's failure in one
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, ShardError):
                raise inner from None
        raise _damaged(folder, exc) from None
    except ShardError:
        raise
    except Exception as exc:  # damaged bytes raise whatever the decoder meets
        raise _damaged(folder, exc) from None


def _damaged(folder: str | Path, exc: BaseException) -> ShardError:
    for failure in getattr(exc, "failures", {}).values():  # what DCP wrapped: the cause
        exc = failure[0] if isinstance(failure, tuple) else failure
        break
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return ShardError(
        f"{folder} holds shards that do not load ({type(exc).__name__}: {first}): the folder "
        "was damaged (a copy cut short?) or written by something else. Fix: use an earlier "
        "checkpoint_* folder of the run, or a checkpoint rayacc wrote"
    )


def read_index(folder: str | Path):
    """The DCP index of a `save_sharded` folder, read safely (a ShardError when it is not one)."""
    return _SafeReader(os.fspath(folder)).read_metadata()


def missing_shard_files(folder: str | Path) -> list[str]:
    """The files a sharded checkpoint's index names that are not in `folder` (a rank's part
    that never arrived): empty when it is complete. The index itself first."""
    folder = Path(folder)
    if not (folder / INDEX_FILE).is_file():
        return [INDEX_FILE]
    metadata = _SafeReader(os.fspath(folder)).read_metadata()
    names = {info.relative_path for info in (metadata.storage_data or {}).values()}
    return sorted(n for n in names if not (folder / n).is_file())
