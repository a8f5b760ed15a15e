"""How a strategy's model and optimizer state goes into a checkpoint and back: composed into a
strategy (`Strategy.state`), not part of its stepping. `WholeState`: rank 0 writes the
unwrapped model's and the optimizer's whole state dicts (a replicated model); `ShardedState`:
every rank writes its shards through `torch.distributed.checkpoint`, which loads at any number
of ranks (a sharded model). Another format (DeepSpeed's own, say) is one more class.

A frozen parameter (a base under adapters) is not state: the build makes it, every format
leaves it out, and a load wants every other value (engine/units.py: `frozen_names`,
`load_weights`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rayacc.engine.units import load_weights, unwrap, without_frozen

__all__ = ["SHARDS_DIR", "ShardedState", "StateFormat", "WholeState", "host_copy"]

SHARDS_DIR = "shards"


def _written() -> None:
    """The wait of a part that is already on disk (or that this rank does not write)."""


def host_copy(state: Any) -> Any:
    """A copy of a state dict's tensors in host memory (off the device: a checkpoint written
    meanwhile holds this moment's state whatever the next steps do); other values as they are."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: host_copy(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(host_copy(v) for v in state)
    return state


class StateFormat(ABC):
    name: str = "whole"
    """What meta.json calls it (`state_format`)."""
    folder: str | None = None
    """The folder of a checkpoint every rank writes its part into (None: rank 0 writes the
    whole state into the checkpoint's state file)."""
    reads_by_writers: bool = False
    """Its parts are read back knowing how many ranks wrote them (meta.json's `num_workers`)."""

    @property
    def writes_shards(self) -> bool:
        """Every rank writes its part of a checkpoint (else rank 0 writes the whole state)."""
        return self.folder is not None

    @abstractmethod
    def save(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        folder: str | Path,
        rank: int,
        *,
        background: bool = False,
    ) -> tuple[dict[str, Any], Callable[[], None]]:
        """Writes this rank's part of the model and optimizer state under `folder`; returns
        what goes whole into the checkpoint's state file (rank 0) and a wait for this rank's
        files. `background`: the state is copied now (training may change it next) and the
        files are written meanwhile; the wait blocks until they are (a collective's own
        group, so training's collectives go on)."""

    @abstractmethod
    def load(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        folder: str | Path,
        saved: dict,
        written_by: int | None = None,
    ) -> None:
        """Loads what `save` wrote (at any number of ranks: `written_by` of them). `folder`:
        the checkpoint's vetted view (its manifests' files only), never the checkpoint's own
        folder."""

    @classmethod
    def resize_issues(cls, written_by: int, workers: int, optimizer: str) -> list[str]:
        """Why a checkpoint `written_by` ranks wrote cannot resume at `workers` under
        `optim.name` `optimizer` (checked on the driver, before a group starts)."""
        return []

    # ------------------------------------------------------------------ read back, no group
    # (load_model, sample, export): the checkpoint layer hands over the folder of the parts
    # (`folder` inside a checkpoint's view) and the ranks that wrote them; a ValueError names
    # the file that is not what this format writes
    @classmethod
    def vet(cls, parts: Path, written_by: int | None) -> None:
        """Every file of the parts as its reader will meet them, read as data."""
        raise ValueError(f"{cls.name}: no parts folder to read back")

    @classmethod
    def open_weights(
        cls, parts: Path, written_by: int | None
    ) -> tuple[dict[str, tuple[int, ...]], Callable[[nn.Module], None]]:
        """The model weights' shapes and a loader of them into a whole model, in one
        process."""
        raise ValueError(f"{cls.name}: no parts folder to read back")


class WholeState(StateFormat):
    def save(self, model, optimizer, folder, rank, *, background=False):
        if rank != 0:
            return {}, _written
        weights = without_frozen(model, unwrap(model).state_dict())
        whole = {"model": weights, "optimizer": optimizer.state_dict()}
        # the state dicts hold the live tensors: a copy, before the next step changes them
        return (host_copy(whole) if background else whole), _written

    def load(self, model, optimizer, folder, saved, written_by=None):
        if "model" not in saved:
            raise ValueError(
                f"{folder} holds a sharded checkpoint (written under FSDP): "
                "this model is replicated"
            )
        load_weights(model, saved["model"])
        optimizer.load_state_dict(saved["optimizer"])


class ShardedState(StateFormat):
    name = "dcp"
    folder = SHARDS_DIR

    def __init__(self) -> None:
        self._group = None
        """A gloo group of its own for background saves (made at the first)."""

    def save(self, model, optimizer, folder, rank, *, background=False):
        from rayacc.engine.parallel.shards import save_sharded

        if not background:
            save_sharded(Path(folder) / SHARDS_DIR, model, optimizer)
            return {}, _written
        if self._group is None:
            # DCP plans and ends a background save with collectives of its own, on the host:
            # on the training group they would interleave with the next windows' collectives
            # (every rank reaches this first save at one step, so the group is made in step)
            self._group = dist.new_group(backend="gloo")
        future = save_sharded(Path(folder) / SHARDS_DIR, model, optimizer, group=self._group)
        return {}, future.result

    @classmethod
    def vet(cls, parts, written_by):
        from rayacc.engine.parallel.shards import ShardError, missing_shard_files

        missing = missing_shard_files(parts)
        if missing:
            raise ShardError(
                f"{parts} lacks {', '.join(missing[:4])}: a rank's part of this sharded "
                "checkpoint never arrived, so it is not loaded. Fix: resume from an earlier "
                "checkpoint_* folder of the run"
            )

    @classmethod
    def open_weights(cls, parts, written_by):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from rayacc.engine.parallel.shards import load_model_shards, read_index

        index = read_index(parts)
        shapes = {
            key.removeprefix("model."): tuple(entry.size)
            for key, entry in (index.state_dict_metadata or {}).items()
            if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
        }
        return shapes, lambda model: load_model_shards(parts, model)

    def load(self, model, optimizer, folder, saved, written_by=None):
        from rayacc.engine.parallel.shards import load_sharded

        shards = Path(folder) / SHARDS_DIR
        if not shards.is_dir():
            raise ValueError(
                f"{folder} holds a whole-model checkpoint (written under DDP): "
                "this model is sharded"
            )
        # each rank reads its rows of every tensor, whatever the size that wrote them
        load_sharded(shards, model, optimizer)
