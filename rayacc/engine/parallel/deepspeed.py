"""DeepSpeed ZeRO (stages 1, 2, 3, with CPU offload): optimizer state, then gradients, then
parameters sharded over the ranks by DeepSpeed's engine, which owns the backward and the
optimizer step. `pip install rayacc[deepspeed]`; DeepSpeed is imported only here, inside a run
that uses it.

The window is rayacc's, not DeepSpeed's: `managed_gradient_accumulation: false` makes every
`engine.step()` a boundary, and the loss each micro-step back-propagates is the item-loss sum
already divided by the window's global item count (× the ranks, which DeepSpeed's reduction
averages over), `engine.backward(..., scale_wrt_gas=False)`: the one normalisation rule, a
short last window exact, clipping (`gradient_clipping`) set from the job (0 = off; DeepSpeed's
own default is 1.0). rayacc owns the batch, the optimizer, the precision and clipping: it
writes those keys, and a user's file that sets them otherwise is an error naming both values.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rayacc.engine.parallel.base import CommStats, ModelRecipe, Strategy, _checkpoint_blocks
from rayacc.engine.parallel.state import StateFormat, _written

__all__ = [
    "DeepSpeed",
    "DeepSpeedConfigError",
    "DeepSpeedState",
    "deepspeed_config",
    "read_zero_weights",
]

TAG = "zero"
"""The folder DeepSpeed's files of a checkpoint go in (its `tag`)."""


class DeepSpeedConfigError(ValueError):
    """A user's DeepSpeed config that disagrees with the job (or that rayacc cannot run)."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems

    def __reduce__(self):
        return (type(self), (self.problems,))


def deepspeed_config(
    *,
    stage: int,
    offload_optimizer: str,
    offload_params: str,
    micro_batch_size: int,
    grad_accum_steps: int,
    num_workers: int,
    max_grad_norm: float | None,
    precision: str,
    user: dict[str, Any] | None = None,
    source: str = "deepspeed.config",
) -> dict[str, Any]:
    """DeepSpeed's config for the job: the user's keys (`user`, read from `source`) with
    rayacc's over them. Raises DeepSpeedConfigError naming every key the user's file sets
    otherwise than the job."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        # small parameters are sharded too: the strategy's memory is what the stage says
        zero["stage3_param_persistence_threshold"] = 0
    if offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": offload_optimizer}
    if offload_params != "none":
        zero["offload_param"] = {"device": offload_params}
    ours: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "train_batch_size": micro_batch_size * grad_accum_steps * num_workers,
        "gradient_clipping": float(max_grad_norm or 0.0),
        "fp16": {"enabled": precision == "fp16"},
        "bf16": {"enabled": precision == "bf16"},
        "zero_optimization": zero,
        "managed_gradient_accumulation": False,
        "zero_allow_untested_optimizer": True,
        # rayacc's optimizer (optim.name) steps offloaded state too: on the CPU it is torch's
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    user = user or {}
    if not isinstance(user, dict):
        raise DeepSpeedConfigError([f"{source}: not a JSON object. Fix: give a JSON object"])
    why = {
        "train_micro_batch_size_per_gpu": "batch.micro_batch_size",
        "gradient_accumulation_steps": "batch.grad_accum_steps (derived)",
        "train_batch_size": "batch.global_batch_size",
        "gradient_clipping": "optim.max_grad_norm (null = 0, off)",
    }
    problems = []
    for key, field in why.items():
        if (
            key in user
            and user[key] != ours[key]
            and not (key == "gradient_clipping" and _same_number(user[key], ours[key]))
        ):
            problems.append(
                f"{source} sets {key}={user[key]!r}, the job {ours[key]!r} ({field}). Fix: "
                f"drop {key} from the file (rayacc writes it) or set {field} to match"
            )
    for key, field in (("optimizer", "optim"), ("scheduler", "optim's schedule")):
        if key in user:
            problems.append(
                f"{source} sets {key!r}: rayacc builds the {key} from the job ({field}). "
                f"Fix: drop {key!r} from the file and set the job's {field} keys"
            )
    for key in ("fp16", "bf16", "amp"):
        enabled = (user.get(key) or {}).get("enabled") if isinstance(user.get(key), dict) else None
        wanted = ours.get(key, {"enabled": False})["enabled"]
        if enabled is not None and bool(enabled) != wanted:
            problems.append(
                f"{source} sets {key}.enabled={enabled!r}, the job's train.precision is "
                f"{precision!r}. Fix: drop {key!r} from the file and set train.precision"
            )
    their_zero = user.get("zero_optimization") or {}
    if isinstance(their_zero, dict):
        for key in ("stage", "offload_optimizer", "offload_param"):
            if key in their_zero and their_zero[key] != zero.get(key):
                field = {
                    "stage": "deepspeed.stage",
                    "offload_optimizer": "deepspeed.offload_optimizer",
                    "offload_param": "deepspeed.offload_params",
                }[key]
                problems.append(
                    f"{source} sets zero_optimization.{key}={their_zero[key]!r}, the job "
                    f"{zero.get(key)!r} ({field}). Fix: drop it from the file and set {field}"
                )
    if problems:
        raise DeepSpeedConfigError(problems)
    merged = copy.deepcopy(user)
    for key, value in ours.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _same_number(a: Any, b: Any) -> bool:
    return isinstance(a, int | float) and not isinstance(a, bool) and math.isclose(a, b)


class DeepSpeed(Strategy):
    """ZeRO through DeepSpeed's engine. `config`: DeepSpeed's config (`deepspeed_config`)."""

    name = "deepspeed"
    can_retry_out_of_memory = False
    fused_sgd = False
    scales_before_backward = True
    owns_optimizer_step = True

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        self.config = config
        stage = config["zero_optimization"]["stage"]
        # ZeRO-3 gathers each module's parameters in its forward: a collective every forward
        self.lockstep = self.gathers_in_forward = stage == 3
        self.holds_whole_gradients = stage < 2
        self.engine: Any = None
        self.state = DeepSpeedState(self)

    def _build(self, recipe: ModelRecipe, device: torch.device) -> nn.Module:
        module = recipe.build()
        _checkpoint_blocks(module, recipe)
        return module.to(device)

    def bind_optimizer(
        self, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """DeepSpeed's engine over the built module and `optimizer` (a torch optimizer it
        shards): the model to train and the optimizer to schedule."""
        deepspeed = import_deepspeed()
        assert self.model is not None
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=self.model, optimizer=optimizer, config=self.config
        )
        self.engine = self.model = engine
        return engine, ds_optimizer

    def setup_reduction(self, count_comm: bool) -> bool:
        # DeepSpeed's reduction averages over the ranks: the loss carries × W / N_window
        return False

    def sync_context(self, sync: bool) -> contextlib.AbstractContextManager[None]:
        # with the window the caller's, every backward reduces (ZeRO-3 reduce-scatters per
        # micro-step in any mode); the boundary cannot be moved under that mode
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)

    def optimizer_step(self) -> tuple[float, str | None]:
        """DeepSpeed's step: clipping as configured, then the optimizer; (gradient norm, why
        skipped or None)."""
        skipped = self.engine.skipped_steps
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        grad_norm = float(norm) if norm is not None else math.nan
        if self.engine.skipped_steps != skipped:
            return grad_norm, "non-finite gradient"
        return grad_norm, None

    def grad_norm(self, grads: list[torch.Tensor], uniform: bool) -> torch.Tensor:
        return torch.tensor(self.engine.get_global_grad_norm() or 0.0)

    def discard_grads(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        if self.engine is not None:
            self.engine.zero_grad()

    def comm_stats(self, micro_steps: int) -> CommStats:
        return CommStats()

    def unwrapped(self) -> nn.Module:
        assert self.model is not None
        return self.engine.module if self.engine is not None else self.model


class DeepSpeedState(StateFormat):
    """DeepSpeed's own checkpoint files, written by every rank (`engine.save_checkpoint`) into
    its part of rayacc's checkpoint (the files of all ranks form DeepSpeed's folder `zero/`),
    read back at the same number of ranks. Written before training goes on (DeepSpeed's save
    has no background mode)."""

    name = "deepspeed"
    folder = TAG

    def __init__(self, strategy: DeepSpeed):
        self.strategy = strategy

    def save(self, model, optimizer, folder, rank, *, background=False):
        engine = self.strategy.engine
        engine.save_checkpoint(str(folder), tag=TAG, save_latest=False)
        # DeepSpeed's rank 0 copies its conversion scripts beside the files: a checkpoint holds
        # data (rank 0 removes them: the folder may be every rank's)
        if rank == 0:
            for script in ("zero_to_fp32.py", "zero_to_torch.py"):
                (Path(folder) / script).unlink(missing_ok=True)
        return {}, _written

    def load(self, model, optimizer, folder, saved):
        if not (Path(folder) / TAG).is_dir():
            raise ValueError(
                f"{folder} holds no DeepSpeed checkpoint (written under another strategy)"
            )
        path, _ = self.strategy.engine.load_checkpoint(str(folder), tag=TAG)
        if path is None:
            raise ValueError(f"DeepSpeed could not load the checkpoint in {folder}")


def import_deepspeed():
    """DeepSpeed, quiet: its log lines below warnings stay off the console
    (`RAYACC_VERBOSE=1` keeps them), its ops built once under rayacc's cache."""
    from rayacc.env import cache_dir

    # DeepSpeed builds its small ops with ninja and g++ on first use: once per machine, here
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache_dir() / "torch_extensions"))
    try:
        import deepspeed
    except ImportError:
        raise ImportError(
            "train.strategy=deepspeed needs DeepSpeed. Fix: pip install 'rayacc[deepspeed]'"
        ) from None
    from deepspeed.utils import logger

    if not os.environ.get("RAYACC_VERBOSE"):
        logger.setLevel(logging.WARNING)
    return deepspeed


# --------------------------------------------------------------- the weights, without DeepSpeed
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
    found = re.fullmatch(r"zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt", path.name)
    return int(found.group(1)) if found else -1


def read_zero_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's fp32 weights (and buffers) from DeepSpeed's checkpoint files in
    `folder` (the `zero/` folder of a rayacc checkpoint), in one process, DeepSpeed neither
    started nor imported: each rank's fp32 partition of the optimizer's flat groups put back
    together as DeepSpeed's `zero_to_fp32` does (stages 1-2: the ranks' partitions end to end,
    stage 3: each parameter's slices from every rank). Files are read as data only.
    ValueError naming the file for anything that is not such a checkpoint."""
    folder = Path(folder)
    models = sorted(folder.glob("*model_states.pt"))
    optims = sorted(folder.glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"), key=_rank_of)
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
