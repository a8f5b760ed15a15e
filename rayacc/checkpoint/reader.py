"""Reading a checkpoint back is parsing untrusted input: a folder from shared storage or a
downloaded run may be damaged, cut short or crafted. Every reader here ends in a loaded value or
one `CheckpointError` naming the file and the fix: never another exception, never code run,
never a read outside the folder (a link or anything but a regular file is refused).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rayacc.checkpoint.format import META_FILE, MODEL_FILE, STATE_FILE
from rayacc.checkpoint.manifest import (
    EARLIER,
    PASSED_OVER_FILE,
    CheckpointError,
    malformed_message,
    manifests,
    not_whole,
    parse_json,
    read_file,
    read_meta,
    verify,
    whole_problems,
)
from rayacc.checkpoint.storage import open_storage
from rayacc.engine.parallel import ShardedState, StateFormat, state_format_named
from rayacc.engine.units import frozen_names, load_weights

__all__ = [
    "EARLIER",
    "PASSED_OVER_FILE",
    "CheckpointError",
    "load_model",
    "malformed_message",
    "manifests",
    "not_whole",
    "parse_json",
    "read_checkpoint",
    "read_file",
    "read_meta",
    "verify",
    "whole_problems",
]


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
    """A sharded checkpoint's parts as their foreign reader will meet them, vetted by the
    strategy's state format (DCP's index read safely and every file it names; DeepSpeed's
    files, every one read as data, exactly the ranks meta.json says wrote them). A
    CheckpointError naming what is not."""
    shards = shards_of(folder, meta)
    if shards is not None:
        fmt, world = _parts_format(folder, meta)
        _as_checkpoint_error(fmt.vet, shards, world)


def _parts_format(folder: Path, meta: dict[str, Any]) -> tuple[type[StateFormat], int | None]:
    """The state format of a checkpoint's parts (meta.json's `state_format`; `dcp` before
    it was written) and the ranks that wrote them (where the format reads by them)."""
    source = str(Path(folder) / META_FILE)
    fmt = state_format_named(meta.get("state_format", ShardedState.name))
    if fmt is None or fmt.folder is None:
        raise CheckpointError(malformed_message(source, "state_format"))
    if not fmt.reads_by_writers:
        return fmt, None
    world = meta.get("num_workers")
    if type(world) is not int or world < 1:
        raise CheckpointError(malformed_message(source, "num_workers"))
    return fmt, world


def _as_checkpoint_error(read, *args):
    """`read(*args)`, its ValueError (a file that is not what the format writes) ours: DCP's
    ShardError names its fix, another is given ours."""
    from rayacc.engine.parallel.shards import ShardError

    try:
        return read(*args)
    except ValueError as exc:
        text = str(exc) if isinstance(exc, ShardError) else f"{exc}. {EARLIER}"
        raise CheckpointError(text) from None


def shards_of(folder: str | Path, meta: dict[str, Any]) -> Path | None:
    """The folder of a sharded checkpoint's model and optimizer shards (inside the checkpoint
    folder, or refused); None when the model is whole in `state.pt`."""
    if not meta.get("shards"):
        return None
    from rayacc.engine.parallel.shards import ShardError, contained

    try:
        return contained(Path(folder), str(meta["shards"]), Path(folder) / META_FILE)
    except ShardError as exc:
        raise CheckpointError(str(exc)) from None


def described_model(
    path: str | Path,
    description: dict,
    factory: str | None,
    shapes: dict[str, tuple[int, ...]] | None = None,
    base: tuple[str | None, object] = (None, None),
) -> nn.Module:
    """The model a checkpoint's description builds (its initial weights). `shapes`: those of
    the weights the checkpoint holds; a built-in model is first built on the meta device and
    must have them, so a description of a huge model costs nothing before it is refused.
    `base`: (the weights folder the caller names as a LoRA run's base, the digest the run
    recorded of its base)."""
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
        hf = cfg.model.hf.model_copy(update={"weights": _base(path, cfg.model, *base)})
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"hf": hf})})
    elif base[0] is not None:
        raise CheckpointError(f"{path}: --base names the base of a LoRA run over hf weights")
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
            # shapes only: a base's weights are not read for them
            hf = cfg.model.hf.model_copy(update={"weights": None})
            shaped = cfg.model_copy(update={"model": cfg.model.model_copy(update={"hf": hf})})
            with torch.device("meta"):
                meta_model = build_model(shaped, info)
            described = {
                k: tuple(v.shape)
                for k, v in meta_model.state_dict().items()
                if isinstance(v, torch.Tensor)
            }
            # a frozen base (adapters) is not in a checkpoint: the build makes it
            frozen = frozen_names(meta_model) - shapes.keys()
            described = {k: v for k, v in described.items() if k not in frozen}
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


def _base(path, model, given: str | None, recorded: object) -> str | None:
    """The weights a LoRA run's base is read from: the folder the caller names, when its
    files are the ones the run trained on (their sha256 in the run's identity)."""
    from rayacc.models.lora import base_identity

    if model.lora is None or not model.hf.weights:
        if given is not None:
            raise CheckpointError(f"{path}: --base names the base of a LoRA run over hf weights")
        return None
    if given is None:
        raise CheckpointError(
            f"{path} holds the adapters of a LoRA run on the base {model.hf.weights}, "
            "which its checkpoints do not hold. Fix: name the base you trust: --base DIR "
            "(load_model(path, base=DIR))"
        )
    if not Path(given).expanduser().is_dir() or base_identity(given) != recorded:
        raise CheckpointError(
            f"--base {given}: not the base the adapters of {path} were trained on (the sha256 "
            "of its files differs from the run's). Fix: the weights folder the run started from"
        )
    return given


def load_model(path: str | Path, factory: str | None = None, base: str | None = None) -> nn.Module:
    """The model saved in a checkpoint folder (or a run folder's newest whole checkpoint),
    with its weights, in eval mode, on the CPU.

    A checkpoint is data: it must not be able to run code here. A built-in model (`mlp`,
    `gpt`) is rebuilt from its description; a user factory's model only when the caller names
    the factory (`factory="package.module:function"`, which the caller trusts): the one the
    checkpoint names is never imported on its word. The factory is called with the
    checkpoint's `model.kwargs`. A LoRA run over hf weights holds the adapters only: its base
    is read from `base`, a folder the caller names, checked against the run's record."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rayacc-view-") as view:
        return _load_model(_checkpoint_of(Path(path)), Path(view), factory, base)


def _checkpoint_of(path: Path) -> Path:
    """`path`, or a run's folder's newest whole checkpoint (as `sample` and `export` take a
    run): a folder without one is read as given (its error names it)."""
    if (path / META_FILE).exists() or not path.is_dir():
        return path
    from rayacc.checkpoint.format import attempt_of, step_of

    # the catalogue's `latest` (which reads through this module): newest first, the first whole
    named = [(step_of(p.name), attempt_of(p.name), p) for p in path.iterdir() if p.is_dir()]
    for *_, folder in sorted((n for n in named if n[0] is not None), reverse=True):
        storage = open_storage(str(folder))
        try:
            if (folder / META_FILE).exists() and not whole_problems(storage, read_meta(storage)):
                return folder
        except (CheckpointError, OSError):
            continue
    return path


def _load_model(path: Path, view: Path, factory: str | None, base: str | None) -> nn.Module:
    state, description, meta = read_checkpoint(path, into=view)
    shards = shards_of(view, meta)
    if shards is None:
        weights = state.get("model")
        if not isinstance(weights, dict):
            raise CheckpointError(malformed_message(str(Path(path) / STATE_FILE), "model"))
        held = {k: tuple(v.shape) for k, v in weights.items() if isinstance(v, torch.Tensor)}
        load = lambda model: load_weights(model, weights)  # noqa: E731
    else:
        fmt, world = _parts_format(view, meta)
        held, load = _as_checkpoint_error(fmt.open_weights, shards, world)
    from rayacc.models.lora import BASE_KEY

    identity = meta.get("identity") if isinstance(meta.get("identity"), dict) else {}
    model = described_model(path, description, factory, held, (base, identity.get(BASE_KEY)))
    from rayacc.engine.parallel.shards import ShardError

    try:
        load(model)
    except Exception as exc:  # weights of another shape, a shard that decodes to nonsense
        if isinstance(exc, ShardError):
            raise CheckpointError(str(exc)) from None
        raise CheckpointError(
            f"{path}'s weights do not fit the model its {MODEL_FILE} describes "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}). {EARLIER}"
        ) from None
    return model.eval()
