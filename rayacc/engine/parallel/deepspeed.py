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
import io
import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rayacc.config.strategies import ADAM_FAMILY
from rayacc.engine.parallel.base import (
    CommStats,
    Contract,
    CostShape,
    ModelRecipe,
    Strategy,
    WingCost,
    _checkpoint_blocks,
    _Timeline,
    _world,
    sharded_cost,
)
from rayacc.engine.parallel.deepspeed_config import deepspeed_config, read_deepspeed_user
from rayacc.engine.parallel.deepspeed_files import read_zero_weights, vet_zero_files
from rayacc.engine.parallel.state import StateFormat, _written
from rayacc.engine.units import frozen_names, load_weights

__all__ = ["DeepSpeed", "DeepSpeedState", "to_universal"]

TAG = "zero"
"""The folder DeepSpeed's files of a checkpoint go in (its `tag`)."""


class DeepSpeedState(StateFormat):
    """DeepSpeed's own checkpoint files, written by every rank (`engine.save_checkpoint`) into
    its part of rayacc's checkpoint (the files of all ranks form DeepSpeed's folder `zero/`),
    read back at the same number of ranks. Written before training goes on (DeepSpeed's save
    has no background mode)."""

    name = "deepspeed"
    folder = TAG
    reads_by_writers = True

    def __init__(self, strategy: DeepSpeed):
        self.strategy = strategy

    @classmethod
    def resize_issues(cls, written_by, workers, optimizer):
        # DeepSpeed's universal checkpoint carries Adam's state only (its converter and its
        # ZeRO-3 loader read `exp_avg` and `exp_avg_sq`): any other would fail in the workers
        if optimizer in ADAM_FAMILY:
            return []
        return [
            f"scaling.num_workers: the run's DeepSpeed checkpoint was written by {written_by} "
            f"workers, this config starts {workers}; DeepSpeed moves a checkpoint to another "
            f"worker count (its universal checkpoint) with Adam's state only, and optim.name is "
            f"{optimizer!r} (set scaling.num_workers: {written_by})"
        ]

    @classmethod
    def vet(cls, parts, written_by):
        vet_zero_files(parts, written_by)

    @classmethod
    def open_weights(cls, parts, written_by):
        # DeepSpeed's files read as data, its runtime neither started nor imported
        zero = read_zero_weights(parts, written_by)
        return {k: tuple(v.shape) for k, v in zero.items()}, lambda m: load_weights(m, zero)

    def save(self, model, optimizer, folder, rank, *, background=False):
        engine = self.strategy.engine
        # a frozen base is not state (state.py): DeepSpeed's own switch leaves it out
        frozen = bool(frozen_names(model))
        engine.save_checkpoint(
            str(folder), tag=TAG, save_latest=False, exclude_frozen_parameters=frozen
        )
        # DeepSpeed's rank 0 copies its conversion scripts beside the files: a checkpoint holds
        # data (rank 0 removes them: the folder may be every rank's)
        if rank == 0:
            for script in ("zero_to_fp32.py", "zero_to_torch.py"):
                (Path(folder) / script).unlink(missing_ok=True)
        return {}, _written

    def load(self, model, optimizer, folder, saved, written_by=None):
        zero = Path(folder) / TAG
        if not zero.is_dir():
            raise ValueError(
                f"{folder} holds no DeepSpeed checkpoint (written under another strategy)"
            )
        if written_by is None:
            raise ValueError(f"{folder}: the number of ranks that wrote it is not known")
        # DeepSpeed unpickles its files whole (weights_only=False), and its converter walks the
        # folder for names it knows: `folder` is the checkpoint's view (its manifests' files
        # only), and each file there is read as data first, exactly the names DeepSpeed writes
        # for `written_by` ranks, so nothing else reaches DeepSpeed's loader
        vet_zero_files(zero, written_by)
        engine = self.strategy.engine
        strict = not frozen_names(model)
        if written_by == _world():
            path, _ = engine.load_checkpoint(str(folder), tag=TAG, load_module_strict=strict)
        else:
            # written at another number of ranks: through DeepSpeed's universal checkpoint
            # (each parameter's fp32 value and optimizer state whole, resharded as it loads);
            # each rank converts the checkpoint for itself, on its local disk
            with tempfile.TemporaryDirectory(prefix="rayacc-universal-") as tmp:
                to_universal(zero, Path(tmp) / TAG)
                engine._config.load_universal_checkpoint = True
                try:
                    path, _ = engine.load_checkpoint(tmp, tag=TAG, load_module_strict=strict)
                finally:
                    engine._config.load_universal_checkpoint = False
        if path is None:
            raise ValueError(f"DeepSpeed could not load the checkpoint in {folder}")


class DeepSpeed(Strategy):
    """ZeRO through DeepSpeed's engine. `config`: DeepSpeed's config (`deepspeed_config`)."""

    name = "deepspeed"
    state_format = DeepSpeedState
    starting = (
        "DeepSpeed: starting its engine on every rank (the first start on a machine builds a "
        "small op of its own with ninja: up to a minute)"
    )

    min_workers = 2
    ZERO_MODES = ((1, False), (2, False), (3, False), (2, True), (3, True))
    """(deepspeed.stage, optimizer offloaded) pairs the planner tries for a DeepSpeed job."""

    @classmethod
    def from_config(cls, cfg, split, user=None, node=None) -> DeepSpeed:
        if split is None:
            world = _world()
            split = cfg.batch_split(num_workers=world)
        ds = cfg.deepspeed
        if user is None:
            user = cls.read_user_config(cfg)
        return cls(
            deepspeed_config(
                stage=ds.stage,
                offload_optimizer=ds.offload_optimizer,
                offload_params=ds.offload_params,
                micro_batch_size=split.micro_batch_size,
                grad_accum_steps=split.grad_accum_steps,
                num_workers=split.num_workers,
                max_grad_norm=cfg.optim.max_grad_norm,
                precision=cfg.train.precision,
                user=user,
                source=f"deepspeed.config={ds.config!r}" if ds.config else "deepspeed.config",
            )
        )

    @classmethod
    def read_user_config(cls, cfg) -> dict[str, Any] | None:
        return read_deepspeed_user(cfg.deepspeed.config)

    @classmethod
    def describe(cls, cfg) -> str:
        d = cfg.deepspeed
        sharded = {
            1: "optimizer state",
            2: "optimizer state and gradients",
            3: "parameters, gradients and optimizer state",
        }[d.stage]
        offload = [
            f"{what} offloaded to CPU"
            for what, where in (
                ("optimizer", d.offload_optimizer),
                ("parameters", d.offload_params),
            )
            if where != "none"
        ]
        return (
            f"DeepSpeed ZeRO-{d.stage} ({sharded} sharded"
            + "".join(f"; {o}" for o in offload)
            + ")"
        )

    @classmethod
    def planner_modes(cls, job_strategy: str) -> list[dict[str, Any]]:
        # tried only where the job runs it: the extra is installed there
        if job_strategy != cls.name:
            return []
        return [
            {"strategy": cls.name, "zero_stage": stage, "offload": offload}
            for stage, offload in cls.ZERO_MODES
        ]

    @classmethod
    def memory_rows(cls, params, workers, slots, activations, **layout):
        return []  # the planner's prior counts ZeRO's stages (`rayacc plan --search`)

    @classmethod
    def cost(cls, shape: CostShape) -> WingCost:
        """ZeRO's stages: each rank's partition of the fp32 master weights and their optimizer
        state (in host memory when offloaded: spared on a GPU), the gradients whole (1) or
        partitioned (2, reduce-scattered each micro-step), the parameters too (3, gathered
        as FSDP's are)."""
        P, n, zero = shape.params, shape.workers, shape.zero_stage
        master = 0.0 if (shape.offload and shape.gpu) else (1 + shape.slots) * P / n
        gathered, latency = 0.0, shape.latency_s
        if zero == 3:
            states = 2 * P / n + master  # parameter and gradient partitions
            gathered, comm = sharded_cost(shape, n, shape.crosses)
        elif zero == 2:
            states = P + P / n + master
            comm = (shape.micro_steps + 1) * (P * shape.gather(n, shape.crosses) + latency)
        else:
            states = 2 * P + master
            comm = latency + P * shape.allreduce(shape.data_parallel, shape.crosses)
        return WingCost(states, gathered, comm if n > 1 else 0.0, n)

    @classmethod
    def candidate_overrides(cls, candidate) -> dict[str, Any]:
        return {
            "deepspeed.stage": candidate.zero_stage,
            "deepspeed.offload_optimizer": "cpu" if candidate.offload else "none",
        }

    def record_files(self) -> dict[str, str]:
        # the config DeepSpeed runs with: the user's file merged under the job's keys
        return {"deepspeed_config.json": json.dumps(self.config, indent=2, sort_keys=True)}

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        self.config = config
        stage = config["zero_optimization"]["stage"]
        self.contract = Contract(
            # its engine owns backward and the step: it takes the mean's gradient
            window_rule="count_first",
            steps="engine",
            # ZeRO-3 gathers each module's parameters in its forward: a collective every forward
            lockstep=stage == 3,
            gathers_in_forward=stage == 3,
            retries_out_of_memory=False,
            fused_sgd=False,
            holds_whole_gradients=stage < 2,
        )
        self.reduces_per_micro_step = stage >= 2
        self.engine: Any = None
        self.state = DeepSpeedState(self)
        self.counter: _CommCounter | None = None

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
        try:
            engine, ds_optimizer, _, _ = deepspeed.initialize(
                model=self.model, optimizer=optimizer, config=self.config
            )
        except RuntimeError as exc:
            if "Error building extension" not in str(exc):
                raise
            raise RuntimeError(
                "DeepSpeed builds a small op of its own with ninja and a C++ compiler at its "
                "first start on a machine (cached in TORCH_EXTENSIONS_DIR, here "
                f"{os.environ.get('TORCH_EXTENSIONS_DIR')}), and the build failed: "
                f"{str(exc).splitlines()[0][:200]}. Fix: install g++ and ninja on every worker "
                "node (`apt-get install g++`, `pip install ninja`), or use train.strategy=ddp "
                "or fsdp"
            ) from None
        self.engine = self.model = engine
        return engine, ds_optimizer

    def setup_reduction(self, count_comm: bool) -> bool:
        if count_comm and _world() > 1:
            self.counter = _CommCounter()
        # DeepSpeed's reduction averages over the ranks: the loss carries × W / N_window
        return False

    def sync_context(self, sync: bool) -> contextlib.AbstractContextManager[None]:
        # with the window the caller's, ZeRO-2 and -3 reduce in every backward (the boundary
        # cannot be moved under that mode), ZeRO-1 in the step
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
            # fp16: DeepSpeed's loss scaler found an overflow, skipped and backed the scale off
            fp16 = self.config["fp16"]["enabled"]
            return grad_norm, "fp16 gradient overflow" if fp16 else "non-finite gradient"
        return grad_norm, None

    def grad_norm(self, grads: list[torch.Tensor], uniform: bool) -> torch.Tensor:
        return torch.tensor(self.engine.get_global_grad_norm() or 0.0)

    def discard_grads(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        if self.engine is None:
            return
        self.engine.zero_grad()
        # the gradients already reduced into this rank's partition survive zero_grad: they are
        # cleared as DeepSpeed's own step clears a window it skips (its overflow path). Under
        # ZeRO-2 some outlive this (measured: tests/distributed/test_deepspeed.py leaves the
        # probe out there): a window rayacc skips after its backward (a non-finite loss) leaves
        # its gradients to the next, whose step DeepSpeed then skips as an overflow
        zero = self.engine.optimizer
        if hasattr(zero, "_overflow_clean_up"):  # ZeRO-3
            zero._overflow_clean_up(getattr(zero, "loss_scale", 1.0))
        elif hasattr(zero, "averaged_gradients"):  # ZeRO-1 and -2
            # a window's first backward starts the partition's gradients anew (not added to
            # those reduced before), as after a step
            zero.micro_step_id = -1
            zero.zero_grad(set_to_none=True)
            release = getattr(zero, "_release_preflattened_grad_buffers", None)
            if release is not None:
                release()
            if getattr(zero, "cpu_offload", False):
                zero.reset_cpu_buffers()
            else:
                for k in zero.averaged_gradients:
                    zero.averaged_gradients[k] = None
                    zero.all_grad_tensors[k] = None

    def begin_window(self) -> None:
        if self.counter is not None:
            self.counter.begin_window()

    def comm_stats(self, micro_steps: int) -> CommStats:
        # with the window the caller's, ZeRO-2 and -3 reduce in every backward; ZeRO-1 reduces
        # once, in the step (measured: tests/distributed/test_deepspeed.py)
        synced = 0 if _world() == 1 else micro_steps if self.reduces_per_micro_step else 1
        if self.counter is None:
            return CommStats(sync_passes=synced)
        c = self.counter
        return CommStats(
            allreduce_calls=c.calls["allreduce"],
            reduce_scatter_calls=c.calls["reduce_scatter"],
            all_gather_calls=c.calls["all_gather"],
            sync_passes=synced,
            sync_time_s=c.timeline.span_s(),
        )

    def unwrapped(self) -> nn.Module:
        assert self.model is not None
        return self.engine.module if self.engine is not None else self.model


class _CommCounter:
    """DeepSpeed's collectives of a window, counted by kind: every one goes through its comm
    backend (`deepspeed.comm`'s `cdb`), whose methods are wrapped on that instance (its own
    comms logger would synchronise the device around each one). rayacc's own collectives go
    through torch.distributed and are not counted. The time is from the first launch to the
    last return (an asynchronous one returns at launch)."""

    def __init__(self) -> None:
        from deepspeed import comm

        self.timeline = _Timeline()
        self.begin_window()
        backend = comm.comm.cdb
        if getattr(backend, "_rayacc_counter", None) is None:
            # wrapped once per process; the strategy built last counts
            for name, kind in _COLLECTIVES.items():
                method = getattr(backend, name, None)
                if method is not None:
                    setattr(backend, name, _counting(backend, method, kind))
        backend._rayacc_counter = self

    def begin_window(self) -> None:
        self.calls = dict.fromkeys(("allreduce", "reduce_scatter", "all_gather"), 0)
        self.timeline.begin_window()


_COLLECTIVES = {
    "all_reduce": "allreduce",
    "all_reduce_coalesced": "allreduce",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "all_gather_into_tensor": "all_gather",
    "all_gather": "all_gather",
    "all_gather_coalesced": "all_gather",
    "all_gather_base": "all_gather",
}
"""DeepSpeed's comm backend methods counted, by kind."""


def _counting(backend, method, kind: str):
    def counted(*args, **kwargs):
        counter = backend._rayacc_counter
        counter.calls[kind] += 1
        gradient = kind != "all_gather"
        if gradient:
            counter.timeline.launched()
        try:
            return method(*args, **kwargs)
        finally:
            if gradient:
                counter.timeline.done()

    return counted


def to_universal(zero: Path, out: Path) -> None:
    """DeepSpeed's universal checkpoint of the ZeRO checkpoint files in `zero`, written to
    `out` (DeepSpeed's `ds_to_universal`, its printing kept off the console)."""
    import argparse

    import_deepspeed()
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(
        input_folder=str(zero),
        output_folder=str(out),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    quiet = not os.environ.get("RAYACC_VERBOSE")
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        ds_to_universal.main(args)


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
