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


def _layout(folder: Path, world: int) -> tuple[list[Path], list[Path]]:
    """(model files, optimizer files by rank) of DeepSpeed's checkpoint of `world` ranks in
    `folder`: exactly the names DeepSpeed writes for that world size, nothing else anywhere
    under it (ValueError naming the first that is not). The ranks are meta.json's, never a
    glob's: a file another attempt or world size left is a stranger, not one more rank."""
    found = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir())
    optims, models = [], []
    for r in range(world):
        names = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"]
        names.append("bf16_" + names[0])
        have = [n for n in names if n in found]
        if len(have) != 1:
            raise ValueError(
                f"{folder} holds {'no' if not have else 'two'} optimizer state file(s) of rank "
                f"{r} of the {world} ranks its checkpoint names"
            )
        optims.append(folder / have[0])
    per_rank = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]
    if "mp_rank_00_model_states.pt" in found:
        models = [folder / "mp_rank_00_model_states.pt"]
    elif all(n in found for n in per_rank):
        models = [folder / n for n in per_rank]  # ZeRO-3: every rank's
    else:
        raise ValueError(f"{folder} holds no DeepSpeed model state file of its {world} ranks")
    expected = {p.relative_to(folder).as_posix() for p in [*models, *optims]}
    strangers = [n for n in found if n not in expected]
    if strangers:
        raise ValueError(
            f"{folder / strangers[0]} is not a file DeepSpeed writes for a checkpoint of {world} "
            f"ranks{f' (and {len(strangers) - 1} more)' if len(strangers) > 1 else ''}: "
            "DeepSpeed's loader and converter would read it by its name, so it is refused"
        )
    return models, optims


def vet_zero_files(folder: Path, world: int) -> int:
    """Reads every file of DeepSpeed's checkpoint of `world` ranks in `folder` as data
    (ValueError naming the one that is not, or a file that does not belong); returns
    `world`."""
    models, optims = _layout(folder, world)
    for path in models:
        _read(path, "module")
    for path in optims:
        _read(path, "optimizer_state_dict")
    return world


def read_zero_weights(folder: str | Path, world: int) -> dict[str, torch.Tensor]:
    """The whole model's fp32 weights (and buffers) from DeepSpeed's checkpoint files of
    `world` ranks in `folder` (the `zero/` folder of a rayacc checkpoint's view), in one
    process, DeepSpeed neither started nor imported: each rank's fp32 partition of the
    optimizer's flat groups put back together as DeepSpeed's `zero_to_fp32` does (stages 1-2:
    the ranks' partitions end to end, stage 3: each parameter's slices from every rank). Files
    are read as data only. ValueError naming the file for anything that is not such a
    checkpoint."""
    folder = Path(folder)
    models, optims = _layout(folder, world)
    model_state = _read(models[0], "module")
    parts = [_read(path, "optimizer_state_dict")["optimizer_state_dict"] for path in optims]
    first = optims[0]
    try:
        stage = int(parts[0]["zero_stage"])
        written = parts[0]["partition_count"]
        written = max(written) if isinstance(written, list) else int(written)
        shapes: list[dict[str, Any]] = list(model_state["param_shapes"])
        buffers = model_state.get("buffer_names") or []
        frozen = model_state.get("frozen_param_shapes") or {}
        shared = dict(model_state.get("shared_params") or {})
        key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
        flats = [list(part[key]) for part in parts]
        paddings = parts[0].get("param_alignment_paddings")
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{first} is not DeepSpeed's ZeRO optimizer state ({exc!r})") from None
    if written != world:
        raise ValueError(
            f"{first} was written by a group of {written} ranks, its checkpoint says {world}"
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
