"""DeepSpeed ZeRO's checkpoint files (`engine/parallel/deepspeed.py` writes them through
DeepSpeed's engine) read back as data, DeepSpeed neither started nor imported: torch's
`weights_only` loader, with the three classes of DeepSpeed's that the files name mapped to
inert stand-ins. A file that names anything else is refused (it could run code)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch

__all__ = ["read_zero_weights", "vet_zero_files"]


class _Held:
    """A stand-in for an object of DeepSpeed's in its checkpoint files (its loss scaler, a
    fragment's address): its fields kept as data, nothing of DeepSpeed's run."""

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _Stage(int):
    """A stand-in for DeepSpeed's ZeroStageEnum (an int)."""


_STAND_INS = [
    (_Held, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_Held, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_Held, "deepspeed.utils.tensor_fragment.fragment_address"),
    (_Stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
]
"""The only classes DeepSpeed's checkpoint files name besides torch's plain data, each read as
inert data (torch's `weights_only` loader with these names mapped to stand-ins)."""


def _read(path: Path, what: str) -> dict[str, Any]:
    import pickle

    try:
        with torch.serialization.safe_globals(_STAND_INS):
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(
            f"{path} holds more than tensors and DeepSpeed's plain values, so it is not loaded "
            f"(it could run code): {str(exc).splitlines()[0][:200]}"
        ) from None
    except Exception as exc:  # a damaged archive raises whatever its parser meets
        raise ValueError(
            f"{path} is not a whole torch archive ({type(exc).__name__}): the checkpoint was "
            "damaged (a copy cut short?) or written by something else"
        ) from None
    if not isinstance(loaded, dict) or not isinstance(loaded.get(what), dict):
        raise ValueError(f"{path} is not DeepSpeed's {what} file (no {what!r} mapping in it)")
    return loaded


def _rank_of(path: Path) -> int:
    # DeepSpeed prefixes the optimizer files of a bf16 run with `bf16_`
    found = re.fullmatch(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt", path.name)
    return int(found.group(1)) if found else -1


def vet_zero_files(folder: Path) -> int:
    """Reads every file of DeepSpeed's checkpoint in `folder` as data (ValueError naming the
    one that is not); returns the number of ranks that wrote it."""
    files = sorted(folder.glob("*.pt"))
    optims = [p for p in files if _rank_of(p) >= 0]
    if not optims or len(optims) == len(files):
        raise ValueError(f"{folder} holds no DeepSpeed model and optimizer state files")
    for path in files:
        _read(path, "optimizer_state_dict" if path in optims else "module")
    return len(optims)


def read_zero_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's fp32 weights (and buffers) from DeepSpeed's checkpoint files in
    `folder` (the `zero/` folder of a rayacc checkpoint), in one process, DeepSpeed neither
    started nor imported: each rank's fp32 partition of the optimizer's flat groups put back
    together as DeepSpeed's `zero_to_fp32` does (stages 1-2: the ranks' partitions end to end,
    stage 3: each parameter's slices from every rank). Files are read as data only.
    ValueError naming the file for anything that is not such a checkpoint."""
    folder = Path(folder)
    models = sorted(folder.glob("*model_states.pt"))
    optims = sorted((p for p in folder.glob("*.pt") if _rank_of(p) >= 0), key=_rank_of)
    if not models or not optims:
        raise ValueError(f"{folder} holds no DeepSpeed model and optimizer state files")
    model_state = _read(models[0], "module")
    parts = [_read(path, "optimizer_state_dict")["optimizer_state_dict"] for path in optims]
    first = optims[0]
    try:
        stage = int(parts[0]["zero_stage"])
        world = parts[0]["partition_count"]
        world = max(world) if isinstance(world, list) else int(world)
        shapes: list[dict[str, Any]] = list(model_state["param_shapes"])
        buffers = model_state.get("buffer_names") or []
        frozen = model_state.get("frozen_param_shapes") or {}
        shared = dict(model_state.get("shared_params") or {})
        key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
        flats = [list(part[key]) for part in parts]
        paddings = parts[0].get("param_alignment_paddings")
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{first} is not DeepSpeed's ZeRO optimizer state ({exc!r})") from None
    if len(optims) != world or [_rank_of(p) for p in optims] != list(range(world)):
        raise ValueError(
            f"{folder} holds the optimizer state of ranks {[_rank_of(p) for p in optims]}, "
            f"written by {world}: a rank's part is missing"
        )
    if frozen:
        raise ValueError(f"{models[0]} holds frozen parameters, which rayacc does not train")
    weights: dict[str, torch.Tensor] = {
        name: value.float() if value.is_floating_point() else value
        for name, value in model_state["module"].items()
        if name in buffers
    }
    try:
        if stage == 3:
            weights |= _zero3_params(shapes, flats, world)
        else:
            weights |= _zero12_params(shapes, flats, world, paddings)
    except (RuntimeError, IndexError, TypeError, ValueError) as exc:
        raise ValueError(
            f"{folder}'s ZeRO-{stage} partitions do not add up to the parameters its model "
            f"state names ({str(exc)[:200]})"
        ) from None
    for name, source in shared.items():
        if source in weights:
            weights[name] = weights[source]
    return weights


def _zero12_params(shapes, flats, world, paddings) -> dict[str, torch.Tensor]:
    # the ranks' partitions end to end are the group's flat vector, each parameter in order
    # (DeepSpeed pads each parameter by `param_alignment_paddings`, the group to 2 × world)
    out = {}
    for group, group_shapes in enumerate(shapes):
        flat = torch.cat([rank_flats[group] for rank_flats in flats])
        offset = 0
        for i, (name, shape) in enumerate(group_shapes.items()):
            numel = math.prod(shape)
            out[name] = flat.narrow(0, offset, numel).view(tuple(shape)).clone()
            offset += numel + (paddings[group][i] if paddings else 0)
        align = 2 * world
        if align * math.ceil(offset / align) != align * math.ceil(flat.numel() / align):
            raise ValueError(f"group {group}: {offset} of {flat.numel()} numbers used")
    return out


def _zero3_params(shapes, flats, world) -> dict[str, torch.Tensor]:
    # each rank holds ceil(numel / world) numbers of every parameter, the parameters in order
    # through its flat groups (one vector here); the last rank's slice padded
    per_rank = [torch.cat(rank_flats) for rank_flats in flats]
    out, offset = {}, 0
    for group_shapes in shapes:
        for name, shape in group_shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            whole = torch.cat([flat.narrow(0, offset, part) for flat in per_rank])
            out[name] = whole[:numel].view(tuple(shape)).clone()
            offset += part
    if offset != per_rank[0].numel():
        raise ValueError(f"{offset} of {per_rank[0].numel()} numbers per rank used")
    return out
