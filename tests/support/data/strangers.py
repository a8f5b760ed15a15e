"""Files a checkpoint's manifests do not list, named as the foreign readers of a checkpoint
match names: the patterns are read from DeepSpeed's and torch's own code (DeepSpeed's checkpoint
constants, DCP's file suffix and index), so a name a new version matches is planted the day it
is installed. Each holds a pickle that runs a command when it is unpickled."""

from __future__ import annotations

import os
import pickle
from pathlib import Path


class Payload:
    """Touches `marker` when unpickled."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def foreign_names(world: int = 2) -> list[str]:
    """Names DeepSpeed's loader and converter or DCP's reader would take for theirs: every
    ZeRO file prefix with a rank of another world size (`world`: the one that wrote the
    checkpoint), model and optimizer suffixes, an extension appended (DeepSpeed's converter
    matches prefixes only), DCP's shard suffix and index."""
    from deepspeed.checkpoint import constants as ds
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

    from rayacc.engine.parallel.shards import INDEX_FILE

    zero_prefixes = [v for k, v in vars(ds).items() if k.endswith("ZERO_FILE_PREFIX")]
    names = []
    for prefix in zero_prefixes:
        names.append(f"{prefix}{world}_{ds.MODEL_FILE_PREFIX}00{ds.OPTIM_FILE_SUFFIX}")
        names.append(f"{prefix}0_{ds.MODEL_FILE_PREFIX}00{ds.MODEL_FILE_SUFFIX}.orig")
    names += [
        f"{ds.MODEL_FILE_PREFIX}00{ds.MODEL_FILE_SUFFIX}.orig",
        f"{ds.MODEL_FILE_PREFIX}01{ds.MODEL_FILE_SUFFIX}",
        f"{ds.LAYER_FILE_PREFIX}01-model_00-model_states.pt",
        f"__{world}_0{DEFAULT_SUFFIX}",
        f"{INDEX_FILE}.orig",
    ]
    return sorted(set(names))


def folders_of(checkpoint: Path) -> list[Path]:
    """The checkpoint folder and every folder inside it, and one that is not there yet."""
    inner = [p for p in checkpoint.rglob("*") if p.is_dir() and not p.is_symlink()]
    return [checkpoint, *sorted(inner), checkpoint / "zero" / "global_step3"]


def plant(folder: Path, name: str, marker: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(pickle.dumps({"module": Payload(str(marker))}))
    return path
