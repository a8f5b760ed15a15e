"""`batch.micro_batch_size: auto`: the largest micro-batch whose forward + backward fits a memory
budget, agreed on by every rank, and never one that changes the global batch.

The candidates are the divisors of one worker's share of the global batch, so the accumulation
derived from any of them keeps the global batch exactly. Memory grows with the micro-batch, so a
binary search over the candidates needs about log2(#divisors) trial steps.

A sharded (FSDP) model's forward and backward are collectives, so its ranks search in lockstep:
every trial's verdict is agreed by all ranks before the next size, and an out-of-memory error
in a trial is raised (a peer may be waiting in a collective the failed rank will never join):
the group restarts and its next search stays below that size.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from rayacc.engine.collectives import all_reduce
from rayacc.engine.losses import Batch, LossFn, summed
from rayacc.engine.parallel import Strategy, strategy_of

__all__ = [
    "MicroBatchSearch",
    "TrialOutOfMemory",
    "agree_on_min",
    "candidate_micro_sizes",
    "find_micro_batch_size",
    "is_oom",
    "largest_fitting",
    "measure_step_bytes",
]


def candidate_micro_sizes(samples_per_worker: int, upper: int | None = None) -> list[int]:
    """Divisors of `samples_per_worker` (at most `upper`), largest first."""
    if samples_per_worker < 1:
        raise ValueError(f"samples_per_worker must be >= 1, got {samples_per_worker}")
    top = min(samples_per_worker, upper or samples_per_worker)
    return [d for d in range(top, 0, -1) if samples_per_worker % d == 0]


def largest_fitting(candidates: Sequence[int], fits: Callable[[int], bool]) -> tuple[int, list]:
    """The largest candidate `fits` accepts, by binary search over `candidates` (largest
    first), assuming what fits stays fitting as it shrinks. Returns it and the trials made as
    (size, fitted). Raises ValueError when not even the smallest fits."""
    order = sorted(candidates)
    trials: list[tuple[int, bool]] = []
    lo, hi, best = 0, len(order) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        ok = fits(order[mid])
        trials.append((order[mid], ok))
        if ok:
            best, lo = order[mid], mid + 1
        else:
            hi = mid - 1
    if best is None:
        raise ValueError(
            f"no micro-batch size fits the memory budget, not even {order[0]} "
            f"(tried {', '.join(str(s) for s, _ in trials)}); raise batch.memory_budget / "
            "batch.memory_budget_mb, or use a smaller model or sequence"
        )
    return best, trials


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc)
    )


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _param_bytes(model: nn.Module) -> int:
    """Bytes of the trainable parameters this rank holds (its shards of a sharded model)."""
    total = 0
    for p in model.parameters():
        if p.requires_grad:
            local = _local(p)
            total += local.numel() * local.element_size()
    return total


def measure_step_bytes(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Batch,
    *,
    autocast_dtype=None,
    optimizer_slots=2,
    strategy: Strategy | None = None,
) -> int:
    """Peak memory of one forward + backward on `batch`, as a non-final micro-step runs it
    (in the strategy's sync context for one: DDP does not sync, FSDP as its mode says), plus
    the `optimizer_slots`
    buffers per parameter the optimizer will hold (AdamW: 2), which do not exist yet before
    the first step. A pipeline's stages run one window of their schedule on `batch` (on CPU
    the most autograd holds saved at once: `_SavedBytes`).

    More: docs/design.md, "Notes from the code" (engine/autobatch.py: measure_step_bytes).
    """
    strategy = strategy or strategy_of(model)
    device = next(model.parameters()).device
    ctx = torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
    optimizer_bytes = optimizer_slots * _param_bytes(model)
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            with ctx:
                _forward_backward(strategy, model, loss_fn, batch)
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device) + optimizer_bytes
        # a layer saves its weight for backward: those bytes are the parameters', counted once
        saved = _SavedBytes({_local(p).untyped_storage().data_ptr() for p in model.parameters()})
        saving = torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t)
        with ctx:
            _forward_backward(strategy, model, loss_fn, batch, saving)
        params = _param_bytes(model)
        # FSDP window_end holds every rank's whole gradients across the window, not its shard
        grads = params * (_world() if strategy.contract.holds_whole_gradients else 1)
        return params + grads + saved.peak + optimizer_bytes
    except RuntimeError as exc:  # torch.OutOfMemoryError is one
        # only running out of memory means "too large"; anything else is a real error
        if not is_oom(exc):
            raise
        return OUT_OF_MEMORY
    finally:
        strategy.discard_grads()
        strategy.restore_sync()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


class _SavedBytes:
    """What autograd holds for backward, as it goes: each storage once while a tensor saved
    of it lives, and the largest sum (`peak`). One micro-step holds all it saves until its
    backward; a pipeline's schedule frees a micro-batch's after its backward, as the next
    ones' are saved."""

    def __init__(self, held: set[int]) -> None:
        self.held = held
        self.live: dict[int, list[int]] = {}  # storage → [bytes, saved tensors of it alive]
        self.now = self.peak = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        # a tensor-parallel layer saves DTensors: their bytes are their local shards'
        storage = _local(t).untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.held:
            return t
        entry = self.live.get(ptr)
        if entry is None:
            entry = self.live[ptr] = [storage.nbytes(), 0]
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        weakref.finalize(t, self._release, ptr)  # autograd holds `t` until it frees it
        return t

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[ptr]
            self.now -= entry[0]


def _forward_backward(
    strategy: Strategy, model: nn.Module, loss_fn: LossFn, batch: Batch, saving=None
) -> None:
    """One non-final micro-step's forward (under `saving`: what it saves counted) and
    backward, or a pipeline's window (its backwards inside the schedule, and any
    recomputation with them; its stages reduce as the schedule does)."""
    saving = saving or contextlib.nullcontext()
    window = strategy.pipeline_window
    if window is not None:
        with saving:
            strategy.run_pipeline([batch] * window[0], loss_fn)
        return
    with strategy.sync_context(False):
        with saving:
            losses = loss_fn(model, batch)
        # through the strategy: an engine that owns the backward (DeepSpeed) must see it
        strategy.backward(summed(losses)[0])


def agree_on_min(value: int, group=None) -> int:
    """The smallest `value` over all ranks (every rank gets the same)."""
    return int(all_reduce(torch.tensor([value], dtype=torch.int64), op="min", group=group).item())


class TrialOutOfMemory(RuntimeError):
    """A sharded model's search trial ran out of memory. Raised, not retried: its peers may
    wait in a collective of that trial; the caller records `micro_batch_size` so that the next
    search (after the group restarts) stays below it."""

    def __init__(self, micro_batch_size: int):
        super().__init__(
            f"micro-batch {micro_batch_size} ran out of device memory in the auto search"
        )
        self.micro_batch_size = micro_batch_size

    def __reduce__(self):
        # rebuilt from its parts where it is unpickled (an error crossing processes, as Ray
        # carries a worker's to the driver): the default would pass the message alone
        return type(self), (self.micro_batch_size,)


OUT_OF_MEMORY = 1 << 62
"""What `measure_step_bytes` reports for a size that ran out of memory."""


@dataclass(frozen=True)
class MicroBatchSearch:
    """What the search chose and what it tried."""

    micro_batch_size: int
    grad_accum_steps: int
    budget_bytes: int
    local_choice: int
    """This rank's own answer before the ranks agreed on the minimum."""
    trials: list[tuple[int, bool]]
    """(micro-batch size, fitted) in the order tried on this rank."""
    out_of_memory: tuple[int, ...] = ()
    """The sizes tried that ran out of device memory (not merely over the budget)."""


def find_micro_batch_size(
    model: nn.Module,
    loss_fn: LossFn,
    make_batch: Callable[[int], Batch],
    *,
    samples_per_worker: int,
    budget_bytes: int,
    autocast_dtype=None,
    optimizer_slots: int = 2,
    group=None,
    below: int | None = None,
    strategy: Strategy | None = None,
) -> MicroBatchSearch:
    """The largest divisor of `samples_per_worker` whose forward + backward on
    `make_batch(size)` stays within `budget_bytes` on every rank; with `below`, only sizes
    smaller than it are tried (a size that ran out of memory in training before).

    The model is left as it was found: no gradient anywhere, gradient sync on, and the random
    state (dropout draws in the trials) as before, so the first step after a search equals the
    first step without one bit for bit."""
    strategy = strategy or strategy_of(model)
    device = next(model.parameters()).device
    out_of_memory: list[int] = []
    lockstep = strategy.contract.lockstep

    def fits(size: int) -> bool:
        used = measure_step_bytes(
            model,
            loss_fn,
            make_batch(size),
            autocast_dtype=autocast_dtype,
            optimizer_slots=optimizer_slots,
            strategy=strategy,
        )
        if used == OUT_OF_MEMORY:
            if lockstep:
                # not agreed on: a peer may wait in a collective of this trial
                raise TrialOutOfMemory(size)
            out_of_memory.append(size)
        if lockstep:
            # every rank's next trial is the same size: a collective forward needs them all
            return agree_on_min(int(used <= budget_bytes), group) == 1
        return used <= budget_bytes

    # the trials' dropout draws leave the random state as it was
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            upper = below - 1 if below is not None else None
            candidates = candidate_micro_sizes(samples_per_worker, upper)
            local, trials = largest_fitting(candidates, fits)
        except ValueError:
            local, trials = 0, []
    chosen = agree_on_min(local, group)
    if chosen == 0:
        raise ValueError(
            f"batch.micro_batch_size=auto: not even a micro-batch of 1 fits the memory budget "
            f"of {budget_bytes / 2**20:,.0f} MiB on some rank; raise batch.memory_budget (GPU "
            "share) or batch.memory_budget_mb, or use a smaller model or sequence"
        )
    return MicroBatchSearch(
        chosen, samples_per_worker // chosen, budget_bytes, local, trials, tuple(out_of_memory)
    )
