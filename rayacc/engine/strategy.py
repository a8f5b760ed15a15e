"""The parallel strategy: everything that differs between replicating a model (DDP) and sharding
it (FSDP2), behind one interface, so that the accumulation step, the micro-batch search and the
worker never ask which one runs.

A strategy owns: building and wrapping the model (materialising a meta-device model's shards,
buffers included), the context a micro-step's forward and backward run in (when gradients
sync), the gradient reduction (a sum over ranks: the step's one multiply by 1 / N_window is the
whole normalisation), the gradient norm, whether forwards are collectives (then the ranks agree
on every count of forwards first), whether an out-of-memory error can be retried in place,
dropping every gradient it holds (internal buffers too), its communication accounting, and
saving / loading the model and optimizer state. Another strategy (HSDP, say) is one more class.
"""

from __future__ import annotations

import contextlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rayacc.engine.collectives import all_reduce
from rayacc.engine.recompute import apply_activation_checkpointing
from rayacc.engine.sync import CommCounter, install_comm_counter, is_ddp
from rayacc.engine.units import GRAD_SYNC_MODES, fsdp_blocks, is_fsdp

__all__ = [
    "DDP",
    "FSDP",
    "STRATEGIES",
    "CommStats",
    "ModelRecipe",
    "Strategy",
    "make_strategy",
    "strategy_of",
    "unwrap",
]

InitialValues = Callable[[str, torch.Size], torch.Tensor]


@dataclass(frozen=True)
class ModelRecipe:
    """How the user's module is made; a strategy builds and wraps it."""

    build: Callable[[], nn.Module]
    """The whole module on the CPU, its weights a function of the seed alone."""
    build_on_meta: Callable[[], nn.Module] | None = None
    """The module with its parameters on the meta device and its buffers real (computed by the
    module's own code), or None when it cannot be built so."""
    initial_values: Callable[[nn.Module], InitialValues | None] | None = None
    """For a meta-built module: `(name, shape) -> full initial value` of each parameter, or
    None when the module does not say how its parameters start (it is then built whole)."""
    activation_checkpointing: int | None = None
    """Recompute every n-th block in backward (1: all); None: off."""
    compile: bool = False


@dataclass(frozen=True)
class CommStats:
    """The gradient communication of one window on this rank."""

    allreduce_calls: int = 0
    reduce_scatter_calls: int = 0
    sync_passes: int = 0
    """Backward passes that synced gradients (1 when accumulation skips the others)."""
    sync_time_s: float = 0.0
    """From the window's first gradient collective launched to the last one done."""


class _Timeline:
    """Launches since the window began, and the span from the first launch to the last
    completion (collectives overlap the backward's compute, so this is an upper bound on what
    they cost)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.begin_window()

    def begin_window(self) -> None:
        self.launches = 0
        self.first: float | None = None
        self.last_done: float | None = None

    def launched(self) -> None:
        with self._lock:
            self.launches += 1
            if self.first is None:
                self.first = time.perf_counter()

    def done(self, *_: Any) -> None:
        with self._lock:
            self.last_done = time.perf_counter()

    def span_s(self) -> float:
        if self.first is None or self.last_done is None:
            return 0.0
        return max(0.0, self.last_done - self.first)


class Strategy(ABC):
    """One way of spreading a model over the ranks. An instance serves one model: `build` (or
    `adopt`, for a model wrapped elsewhere) binds it."""

    name: str = ""
    lockstep: bool = False
    """Every forward is a collective (parameters are gathered): a rank with one forward more
    than the others would wait forever, so counts of forwards are agreed first."""
    can_retry_out_of_memory: bool = True
    """An out-of-memory error before a window's syncing micro-step can be retried in place
    (nothing is waiting on this rank in a collective)."""
    writes_shards: bool = False
    """Every rank writes its part of a checkpoint (else rank 0 writes the whole state)."""
    fused_sgd: bool = True
    """PyTorch's fused SGD kernel can step this strategy's parameters."""
    gathers_in_forward: bool = False
    """Parameters are whole only inside the forward that gathered them: a loss that uses a
    module's weights (the chunked loss's head) runs inside the model's forward."""
    holds_whole_gradients: bool = False
    """Every rank holds gradients of the whole model across a window (not only its shard's)."""

    def __init__(self) -> None:
        self.model: nn.Module | None = None

    # ------------------------------------------------------------------ build
    def build(self, recipe: ModelRecipe, device: torch.device) -> nn.Module:
        """The model of `recipe` on `device`, wrapped for this strategy."""
        self.model = self._build(recipe, device)
        return self.model

    @abstractmethod
    def _build(self, recipe: ModelRecipe, device: torch.device) -> nn.Module: ...

    def adopt(self, model: nn.Module) -> Strategy:
        """Binds a model wrapped by the caller (DDP, or sharded with `fully_shard`)."""
        self.model = model
        return self

    @property
    def process_group(self):
        """The group the gradients sync over (None: the default group)."""
        return getattr(self.model, "process_group", None) if is_ddp(self.model) else None

    # ------------------------------------------------------------------ the step
    @abstractmethod
    def setup_reduction(self, count_comm: bool) -> bool:
        """Prepares the gradient reduction; True when it sums over ranks (the step then
        divides by N_window), False when it averages (DDP's own hook: × W / N_window)."""

    @abstractmethod
    def sync_context(self, sync: bool) -> contextlib.AbstractContextManager[None]:
        """Wraps a micro-step's forward and backward; `sync` on the window's last."""

    def agree_forwards(self, n: int, group=None) -> int:
        """How many forwards every rank runs when this one has `n` to run (lockstep: the most
        of any rank; a rank with fewer pads them)."""
        return n

    def attach_window_stats(  # noqa: B027 (default: the stats are all-reduced on their own)
        self, stats: torch.Tensor, exact_in_fp32: bool
    ) -> None:
        """Offers the window's statistics to ride with the gradient reduction."""

    def reduced_window_stats(self, stats: torch.Tensor, group=None) -> torch.Tensor:
        """The window's statistics summed over the ranks."""
        return all_reduce(stats, group=group)

    @abstractmethod
    def grad_norm(self, grads: list[torch.Tensor], uniform: bool) -> torch.Tensor:
        """The gradient norm over all parameters of all ranks."""

    def discard_grads(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Drops every gradient this rank holds: the parameters' and the strategy's own
        buffers, so the next backward starts from nothing."""
        assert self.model is not None
        params = (
            [p for g in optimizer.param_groups for p in g["params"]]
            if optimizer is not None
            else list(self.model.parameters())
        )
        for p in params:
            p.grad = None

    def restore_sync(self) -> None:  # noqa: B027 (default: sync is decided per micro-step)
        """Leaves gradient sync as a fresh model has it (after a search's trials)."""

    def begin_window(self) -> None:  # noqa: B027 (default: nothing counted)
        """Starts counting a window's communication."""

    def comm_stats(self, micro_steps: int) -> CommStats:
        return CommStats()

    # ------------------------------------------------------------------ state
    @abstractmethod
    def save(
        self,
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
    def load(self, optimizer: torch.optim.Optimizer, folder: str | Path, saved: dict) -> None:
        """Loads what `save` wrote (at any number of ranks)."""

    def unwrapped(self) -> nn.Module:
        """The user's module inside the wrappers (its parameters as the strategy holds them)."""
        assert self.model is not None
        return unwrap(self.model)


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DistributedDataParallel and torch.compile wrappers."""
    while True:
        if is_ddp(model):
            model = model.module
        elif type(model).__name__ == "OptimizedModule":  # torch.compile's wrapper
            model = model._orig_mod
        else:
            return model


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


def _written() -> None:
    """The wait of a part that is already on disk (or that this rank does not write)."""


def _checkpoint_blocks(module: nn.Module, recipe: ModelRecipe) -> None:
    if recipe.activation_checkpointing is not None:
        blocks = fsdp_blocks(module)
        if blocks:  # none: the driver has warned
            apply_activation_checkpointing(blocks, recipe.activation_checkpointing)


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class DDP(Strategy):
    """Every rank holds the whole model; gradients are all-reduced in buckets during the
    window's last backward (DistributedDataParallel; `no_sync` on the micro-steps before)."""

    name = "ddp"

    def __init__(self) -> None:
        super().__init__()
        self.comm: CommCounter | None = None

    def _build(self, recipe: ModelRecipe, device: torch.device) -> nn.Module:
        module = recipe.build()
        _checkpoint_blocks(module, recipe)
        module = module.to(device)
        if recipe.compile:
            # compiled before DDP wraps it: no_sync and the gradient hooks stay outside it
            module = torch.compile(module)
        if _world() == 1:
            return module
        ids = [device.index if device.index is not None else 0] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(module, device_ids=ids)

    def setup_reduction(self, count_comm: bool) -> bool:
        assert self.model is not None
        if _world() > 1 and not is_ddp(self.model):
            raise ValueError(
                f"torch.distributed runs {_world()} ranks but the model is neither wrapped in "
                "DistributedDataParallel nor sharded with fully_shard: gradients would never "
                "sync. Build it with a strategy (or wrap it)."
            )
        # the engine's hook sums gradients over ranks; DDP's default one averages
        self.comm = install_comm_counter(self.model, average=False) if count_comm else None
        return self.comm is not None or not is_ddp(self.model)

    def sync_context(self, sync: bool) -> contextlib.AbstractContextManager[None]:
        # around forward *and* backward: DDP marks what to reduce during forward, so a
        # `no_sync` around backward alone still all-reduces
        if sync or not is_ddp(self.model):
            return contextlib.nullcontext()
        return self.model.no_sync()

    def attach_window_stats(self, stats: torch.Tensor, exact_in_fp32: bool) -> None:
        if self.comm is not None:
            self.comm.attach_window_stats(stats, exact_in_fp32=exact_in_fp32)

    def reduced_window_stats(self, stats: torch.Tensor, group=None) -> torch.Tensor:
        reduced = self.comm.reduced_window_stats() if self.comm is not None else None
        return reduced if reduced is not None else all_reduce(stats, group=group)

    def grad_norm(self, grads: list[torch.Tensor], uniform: bool) -> torch.Tensor:
        if uniform:
            # get_total_norm without its grouping by device and dtype, which costs as much as
            # the norms on a small model
            return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        return torch.nn.utils.get_total_norm(grads)

    def begin_window(self) -> None:
        if self.comm is not None:
            self.comm.begin_window()

    def comm_stats(self, micro_steps: int) -> CommStats:
        if self.comm is None:
            return CommStats()
        return CommStats(
            allreduce_calls=self.comm.launches,
            sync_passes=self.comm.passes,
            sync_time_s=self.comm.sync_time_s(),
        )

    def save(
        self,
        optimizer: torch.optim.Optimizer,
        folder: str | Path,
        rank: int,
        *,
        background: bool = False,
    ) -> tuple[dict[str, Any], Callable[[], None]]:
        if rank != 0:
            return {}, _written
        whole = {"model": self.unwrapped().state_dict(), "optimizer": optimizer.state_dict()}
        # the state dicts hold the live tensors: a copy, before the next step changes them
        return (host_copy(whole) if background else whole), _written

    def load(self, optimizer: torch.optim.Optimizer, folder: str | Path, saved: dict) -> None:
        if "model" not in saved:
            raise ValueError(
                f"{folder} holds a sharded checkpoint (written under FSDP): "
                "this model is replicated"
            )
        self.unwrapped().load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])


SHARDS_DIR = "shards"


class FSDP(Strategy):
    """Parameters, gradients and optimizer state sharded over the ranks (FSDP2 `fully_shard`
    per block, then at the root). `grad_sync`: `every_micro_step` reduce-scatters after every
    micro-step (least memory); `window_end` holds the unsharded gradients across the window and
    reduce-scatters once."""

    name = "fsdp"
    lockstep = True
    # a peer may be waiting in a gather or reduce-scatter this rank will never join
    can_retry_out_of_memory = False
    writes_shards = True
    # the fused SGD kernel has no rule for sharded (DTensor) parameters
    fused_sgd = False
    gathers_in_forward = True

    def __init__(
        self,
        grad_sync: str = "every_micro_step",
        *,
        reshard_after_forward: bool = True,
        param_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if grad_sync not in GRAD_SYNC_MODES:
            raise ValueError(f"grad_sync={grad_sync!r} is not one of {', '.join(GRAD_SYNC_MODES)}")
        self.grad_sync = grad_sync
        self.holds_whole_gradients = grad_sync == "window_end"
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = param_dtype
        self._timeline = _Timeline()
        self.counted = False
        self._unit_list: list[nn.Module] | None = None
        self._checkpoint_group: Any = None

    def _build(self, recipe: ModelRecipe, device: torch.device) -> nn.Module:
        from rayacc.engine.fsdp import materialize_shards, shard_model

        module = recipe.build_on_meta() if recipe.build_on_meta else recipe.build()
        values = None
        if any(p.is_meta for p in module.parameters()):
            values = recipe.initial_values(module) if recipe.initial_values else None
            if values is None:
                # no rule for each parameter's start: built whole on every rank, then sharded
                module = recipe.build()
        _checkpoint_blocks(module, recipe)
        if recipe.compile:
            # each block compiled in place before it is sharded (names, and so checkpoints,
            # stay): FSDP's gathers and reduce-scatters run between the compiled blocks
            for block in fsdp_blocks(module):
                block.compile()
        if values is None:
            module = module.to(device)
        shard_model(
            module,
            device=device,
            reshard_after_forward=self.reshard_after_forward,
            param_dtype=self.param_dtype,
        )
        if values is not None:
            materialize_shards(module, device, values)
        return module

    def adopt(self, model: nn.Module) -> Strategy:
        if not is_fsdp(model):
            raise ValueError("the FSDP strategy needs a model sharded with fully_shard")
        return super().adopt(model)

    def _units(self) -> list[nn.Module]:
        if self._unit_list is None:
            self._unit_list = [m for m in self.model.modules() if is_fsdp(m)]
        return self._unit_list

    def setup_reduction(self, count_comm: bool) -> bool:
        from rayacc.engine.fsdp import CountingReduceScatter

        for unit in self._units():
            # a sum over ranks: the step's multiply by 1 / N is the whole normalisation
            unit.set_gradient_divide_factor(1.0)
            # a plain SUM (not NCCL's PreMulSum by 1, which gloo lacks)
            unit.set_force_sum_reduction_for_comms(True)
        self.counted = count_comm
        if count_comm:
            reduce_scatter = CountingReduceScatter(self._timeline)
            for unit in self._units():
                unit.set_custom_reduce_scatter(reduce_scatter)
        return True

    def sync_context(self, sync: bool) -> contextlib.AbstractContextManager[None]:
        # FSDP2's forward gathers and its backward reduce-scatters per unit; a DDP-style
        # `no_sync` would do nothing. With `every_micro_step` every backward syncs.
        if self.grad_sync == "window_end":
            self.model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def agree_forwards(self, n: int, group=None) -> int:
        if _world() == 1:
            return n
        return int(all_reduce(torch.tensor([float(n)]), op="max", group=group).item())

    def grad_norm(self, grads: list[torch.Tensor], uniform: bool) -> torch.Tensor:
        # the sharded gradients' norms combined over the ranks: a collective
        norm = torch.nn.utils.get_total_norm(grads)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def discard_grads(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        super().discard_grads(optimizer)
        from rayacc.engine.fsdp import drop_unsynced_grads

        # a backward that did not reduce-scatter leaves unsharded gradients inside FSDP, which
        # the next synced backward would add to its own
        drop_unsynced_grads(self._units())

    def restore_sync(self) -> None:
        self.model.set_requires_gradient_sync(True)

    def begin_window(self) -> None:
        self._timeline.begin_window()

    def comm_stats(self, micro_steps: int) -> CommStats:
        synced = 0
        if _world() > 1:
            synced = micro_steps if self.grad_sync == "every_micro_step" else 1
        if not self.counted:
            return CommStats(sync_passes=synced)
        return CommStats(
            reduce_scatter_calls=self._timeline.launches,
            sync_passes=synced,
            sync_time_s=self._timeline.span_s(),
        )

    def save(
        self,
        optimizer: torch.optim.Optimizer,
        folder: str | Path,
        rank: int,
        *,
        background: bool = False,
    ) -> tuple[dict[str, Any], Callable[[], None]]:
        from rayacc.engine.shards import save_sharded

        if not background:
            save_sharded(Path(folder) / SHARDS_DIR, self.model, optimizer)
            return {}, _written
        if self._checkpoint_group is None:
            # DCP plans and ends a background save with collectives of its own, on the host:
            # on the training group they would interleave with the next windows' collectives
            # (every rank reaches this first save at one step, so the group is made in step)
            self._checkpoint_group = dist.new_group(backend="gloo")
        future = save_sharded(
            Path(folder) / SHARDS_DIR, self.model, optimizer, group=self._checkpoint_group
        )
        return {}, future.result

    def load(self, optimizer: torch.optim.Optimizer, folder: str | Path, saved: dict) -> None:
        from rayacc.engine.shards import load_sharded

        shards = Path(folder) / SHARDS_DIR
        if not shards.is_dir():
            raise ValueError(
                f"{folder} holds a whole-model checkpoint (written under DDP): "
                "this model is sharded"
            )
        # each rank reads its rows of every tensor, whatever the size that wrote them
        load_sharded(shards, self.model, optimizer)


STRATEGIES: dict[str, type[Strategy]] = {"ddp": DDP, "fsdp": FSDP}


def make_strategy(name: str, **options: Any) -> Strategy:
    """The strategy called `name` (`train.strategy`) with its options."""
    if name not in STRATEGIES:
        raise ValueError(f"strategy {name!r} is not one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name](**options)


def strategy_of(model: nn.Module, **options: Any) -> Strategy:
    """The strategy a model wrapped by the caller was wrapped for, bound to it."""
    if is_fsdp(model):
        return FSDP(**options).adopt(model)
    return DDP().adopt(model)
