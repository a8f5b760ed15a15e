"""What every parallel strategy shares: the `Strategy` interface the accumulation step, the
micro-batch search and the worker call (they never ask which strategy runs), the model's recipe,
the window's communication figures, and the helpers the strategies use."""

from __future__ import annotations

import contextlib
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from rayacc.engine.collectives import all_reduce
from rayacc.engine.recompute import apply_activation_checkpointing
from rayacc.engine.units import fsdp_blocks, is_ddp, unwrap

if TYPE_CHECKING:
    from rayacc.config import TrainConfig
    from rayacc.config.batch_split import BatchSplit
    from rayacc.engine.parallel.state import StateFormat

__all__ = [
    "CommStats",
    "Contract",
    "CostShape",
    "ModelRecipe",
    "PipelineStats",
    "Strategy",
    "WingCost",
    "sharded_cost",
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
    tokens: int | None = None
    """Input tokens of the data's longest row (None: not token data): what a pipeline's
    stages size their buffers for, rather than the longest sequence the model takes."""


@dataclass(frozen=True)
class Contract:
    """What a strategy promises the accumulation step, the micro-batch search and the optimizer
    builder: declared once by the strategy, read once where they are built (the step picks its
    window rule and who steps at construction; no flag is asked per window)."""

    window_rule: Literal["count_after", "count_first"] = "count_after"
    """count_after: item-loss sums are back-propagated and divided once the window's count is
    known (one all-reduce after backward); count_first: the counts are all-reduced first and
    the loss divided by N before backward (an engine that owns backward takes the mean's
    gradient)."""
    steps: Literal["accumulation", "engine"] = "accumulation"
    """Who unscales, clips and steps: the accumulation step, or the strategy's own engine
    (`Strategy.optimizer_step`)."""
    lockstep: bool = False
    """Every forward is a collective (parameters are gathered): the ranks agree on the count
    of forwards first, or one with a forward more would wait forever."""
    retries_out_of_memory: bool = True
    """An out-of-memory error before a window's syncing micro-step can be retried in place
    (no peer is waiting on this rank in a collective)."""
    fused_sgd: bool = True
    """PyTorch's fused SGD kernel can step the parameters."""
    gathers_in_forward: bool = False
    """Parameters are whole only inside the forward that gathered them: a loss that uses a
    module's weights (the chunked loss's head) runs inside the model's forward."""
    holds_whole_gradients: bool = False
    """Every rank holds gradients of the whole model across a window (not only its shard)."""
    pipelined: bool = False
    """A window's micro-batches run through a pipeline schedule in one call
    (`Strategy.run_pipeline`), not one forward and backward each."""


@dataclass(frozen=True)
class GroupCalls:
    """The collectives one group of ranks ran in a window, by kind."""

    allreduce: int = 0
    all_gather: int = 0
    reduce_scatter: int = 0

    def __add__(self, other: GroupCalls) -> GroupCalls:
        return GroupCalls(
            self.allreduce + other.allreduce,
            self.all_gather + other.all_gather,
            self.reduce_scatter + other.reduce_scatter,
        )

    def __mul__(self, n: int) -> GroupCalls:
        return GroupCalls(self.allreduce * n, self.all_gather * n, self.reduce_scatter * n)


@dataclass(frozen=True)
class PipelineStats:
    """A pipeline stage's window: what it sent, how long it stood idle, and the schedule's own
    idle share."""

    p2p_sends: int
    """Tensors sent to another rank (activations forward, their gradients back)."""
    idle_s: float
    """The schedule step's time this rank computed nothing (waiting for its neighbours)."""
    bubble: float
    """The schedule's idle share, (P − 1) / (v·m + P − 1) for m micro-batches, v stages per
    rank (ZBV's zero-bubble V idles less)."""


@dataclass(frozen=True)
class CostShape:
    """What a wing's cost model (`Strategy.cost`) reads of one planner candidate: the bytes of
    the model part a rank's group holds (the mesh's other degrees already taken out), how the
    candidate spreads it, and the links' measured rates (planner/prior.py makes it)."""

    params: float
    """Bytes of the parameters one model-parallel part holds (the whole model without one)."""
    workers: int
    data_parallel: int
    shard_ranks: int
    """The ranks a sharded state is split over (HSDP: a replica group's)."""
    replicate: int
    micro_steps: int
    slots: int
    """The optimizer's state per parameter (AdamW: 2)."""
    gpu: bool
    offload: bool
    grad_sync: str | None
    zero_stage: int | None
    reshard_after_forward: bool
    bf16_gathers: bool
    largest_unit: float
    """Bytes of the largest unit a sharding strategy gathers at once."""
    recomputed: float
    """Bytes of the blocks activation checkpointing recomputes (their gathers not held)."""
    units: int
    latency_s: float
    allreduce: Callable[[int, bool], float]
    """Seconds per byte of an all-reduce over `ranks` (crossing nodes or not)."""
    gather: Callable[[int, bool], float]
    """Seconds per byte of an all-gather or reduce-scatter over `ranks`."""
    crosses: bool
    """The candidate's workers span nodes."""
    host_link: float
    """Bytes per second between host and device (an offloaded model's copies)."""


@dataclass(frozen=True)
class WingCost:
    """A wing's answer: its state's bytes per rank, what it gathers while computing, its
    communication per window and the ranks its optimizer step is split over."""

    states: float
    gathered: float
    comm_s: float
    optimizer_ranks: int


def sharded_cost(shape: CostShape, shard: int, crosses: bool) -> tuple[float, float]:
    """Bytes gathered at once and a window's gathers and reduce-scatters of a model whose
    parameters are sharded over `shard` ranks (FSDP, ZeRO-3)."""
    P, a = shape.params, shape.micro_steps
    if shape.gpu and shape.reshard_after_forward:
        gathered = min(P, 2 * shape.largest_unit)
    else:
        # a recomputed block saves only its input in forward, not its gathered weights
        gathered = P - shape.recomputed
    half = 0.5 if shape.bf16_gathers else 1.0
    per_byte, latency = shape.gather(shard, crosses), shape.latency_s
    gathers = (2 if shape.reshard_after_forward else 1) * (
        P * half * per_byte + shape.units * latency
    )
    reduce_scatter = P * per_byte + shape.units * latency
    syncs = 1 if shape.grad_sync == "window_end" else a
    return gathered * half, a * gathers + syncs * reduce_scatter


@dataclass(frozen=True)
class CommStats:
    """The gradient communication of one window on this rank."""

    allreduce_calls: int = 0
    reduce_scatter_calls: int = 0
    all_gather_calls: int = 0
    """Parameter all-gathers (ZeRO-3 gathers each module's parameters in its forward and
    backward)."""
    sync_passes: int = 0
    """Backward passes that synced gradients (1 when accumulation skips the others)."""
    sync_time_s: float = 0.0
    """From the window's first gradient collective launched to the last one done."""
    tensor_parallel: GroupCalls | None = None
    """The tensor-parallel group's collectives (its layers' and the gradient norm's), apart
    from the data-parallel ones above; None without tensor parallelism."""
    pipeline: PipelineStats | None = None
    """None without pipeline parallelism."""


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
    starting: str = ""
    """What a group's start spends long on under it, said on the console as the group starts
    ("": nothing worth a line)."""
    contract: Contract = Contract()
    """What it promises the step (set by a strategy whose promises depend on its settings)."""

    state: StateFormat
    """How its model and optimizer state goes into a checkpoint and back (parallel/state.py)."""
    state_format: type[StateFormat]
    """The class of `state`: what reads its checkpoints back without a process group."""
    min_workers: int = 1
    """The fewest workers the planner tries it at (a sharding strategy has nothing to shard
    on one)."""

    # ------------------------------------------------------------------ from the config
    @classmethod
    def from_config(
        cls, cfg: TrainConfig, split: BatchSplit | None, user: Any = None, node: str | None = None
    ) -> Strategy:
        """The strategy with its section's options (`user`: what `read_user_config` read on the
        driver; `node`: the node this rank runs on)."""
        return cls()

    @classmethod
    def read_user_config(cls, cfg: TrainConfig) -> Any:
        """A file of the strategy's own the config names, read on the driver (None: none)."""
        return None

    @classmethod
    def describe(cls, cfg: TrainConfig) -> str:
        """How it spreads the model, for the run's header."""
        return cls.name

    @classmethod
    def planner_modes(cls, job_strategy: str) -> list[dict[str, Any]]:
        """Each way of running it the planner tries, as `Candidate` fields, for a job that
        runs `job_strategy`."""
        return [{"strategy": cls.name}]

    @classmethod
    def sharding_variants(
        cls, mode: dict[str, Any], nodes: int, workers: int
    ) -> list[dict[str, Any]]:
        """A planner mode and its variants at `workers` over `nodes`."""
        return [mode]

    @classmethod
    def memory_rows(
        cls, params: float, workers: int, slots: int, activations: float | None, **layout: Any
    ) -> list[tuple[str, float, float, float, float | None]]:
        """The estimate `rayacc plan` shows per rank: (label, parameters, gradients, optimizer
        state, activations), in the unit of `params` (the model's parameters a rank's group
        holds); `workers`: the ranks a sharded state is split over; `layout`: the mesh's other
        degrees where they change the rows (`pipelined`: a rank is a pipeline's stage)."""
        return [(cls.name, params, params, slots * params, activations)]

    @classmethod
    def cost(cls, shape: CostShape) -> WingCost:
        """Its memory per rank and communication per window for the planner's prior: here the
        whole model on every rank (parameters, gradients, the optimizer's state; a GPU's
        gradient buckets) and one all-reduce of the gradients a window."""
        P, n = shape.params, shape.workers
        states = (2 + shape.slots) * P + (P if shape.gpu and n > 1 else 0.0)
        comm = shape.latency_s + P * shape.allreduce(shape.data_parallel, shape.crosses)
        return WingCost(states, 0.0, comm if n > 1 else 0.0, 1)

    @classmethod
    def candidate_overrides(cls, candidate: Any) -> dict[str, Any]:
        """The config keys of its section a planner candidate sets."""
        return {}

    def __init__(self) -> None:
        self.model: nn.Module | None = None

    @property
    def writes_shards(self) -> bool:
        """Every rank writes its part of a checkpoint (else rank 0 writes the whole state)."""
        return self.state.writes_shards

    # ------------------------------------------------------------------ build
    def build(self, recipe: ModelRecipe, device: torch.device) -> nn.Module:
        """The model of `recipe` on `device`, wrapped for this strategy."""
        self.model = self._build(recipe, device)
        return self.model

    @abstractmethod
    def _build(self, recipe: ModelRecipe, device: torch.device) -> nn.Module: ...

    def bind_optimizer(
        self, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The model to train and the optimizer to schedule, once the optimizer over the built
        model's parameters exists (an engine that owns the step wraps both)."""
        assert self.model is not None
        return self.model, optimizer

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

    def local_gradients(self):
        """The probe its reduction hooks feed each rank's gradient sum into
        (`engine/noise.LocalGradients`), or None: it measures none."""
        return None

    def attach_window_stats(  # noqa: B027 (default: the stats are all-reduced on their own)
        self, stats: torch.Tensor, exact_in_fp32: bool
    ) -> None:
        """Offers the window's statistics to ride with the gradient reduction."""

    def reduced_window_stats(self, stats: torch.Tensor, group=None) -> torch.Tensor:
        """The window's statistics summed over the ranks."""
        return all_reduce(stats, group=group)

    def run_pipeline(self, micro_batches, loss_fn, train=True) -> tuple[list[float], int]:
        """Where `contract.pipelined`: the window's forwards and backwards (`train`; else the
        forwards only); (the item-loss sum of each micro-batch, the items the loss function
        counted itself) on the rank that holds the losses, ([], 0) elsewhere."""
        raise NotImplementedError(f"{self.name} runs no pipeline")

    @property
    def pipeline_window(self) -> tuple[int, int] | None:
        """Where `contract.pipelined`: (micro-batches, rows each) of the schedule's window."""
        return None

    @property
    def holds_loss(self) -> bool:
        """This rank computes the losses (every rank but a pipeline's earlier stages)."""
        return True

    def backward(self, loss: torch.Tensor) -> None:
        """A micro-step's backward."""
        loss.backward()

    def optimizer_step(self) -> tuple[float, str | None]:
        """Clip and step where `contract.steps` is the engine: (grad norm, why skipped or None)."""
        raise NotImplementedError(f"{self.name}: the accumulation step steps the optimizer")

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

    def describe_mesh(self) -> str:
        """How the built model is laid over the group's ranks where the group decided it
        (FSDP's mesh), for the run's record; "" where the config alone says it."""
        return ""

    @property
    def data_group(self):
        """The group whose ranks split the rows (this rank's rank in it: its data rank); the
        counts' group where every rank of that reads its own (None: the default group)."""
        return self.process_group

    @property
    def figures_group(self):
        """The group that holds the ranks `process_group` leaves out (the tensor-parallel
        group), over which the ranks' figures are completed; None: it leaves none out."""
        return None

    def mesh_coordinates(self) -> tuple[tuple[tuple[str, int], ...], ...]:
        """Each rank's place on the mesh by dimension, in rank order (`(("dp", 1), ("tp",
        0))`), where the ranks are more than their data-parallel rank; () elsewhere."""
        return ()

    def record_files(self) -> dict[str, str]:
        """Files of the strategy's own configuration the run's record keeps (name → text)."""
        return {}

    def unwrapped(self) -> nn.Module:
        """The user's module inside the wrappers (its parameters as the strategy holds them)."""
        assert self.model is not None
        return unwrap(self.model)


def _checkpoint_blocks(module: nn.Module, recipe: ModelRecipe) -> None:
    if recipe.activation_checkpointing is not None:
        blocks = fsdp_blocks(module)
        if blocks:  # none: the driver has warned
            apply_activation_checkpointing(blocks, recipe.activation_checkpointing)


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
