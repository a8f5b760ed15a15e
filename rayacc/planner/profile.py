"""What the planner's prior is made of, measured on the worker group's own devices: one
forward + backward of the plain model at a few micro-batch sizes per activation-checkpointing
setting (time, and memory as the auto search counts it), one optimizer step, the collectives'
time per byte, and the fixed cost of a real window. Pure torch (plus `torch.distributed` when
the group has several ranks); every figure is the slowest rank's. (The strategies' fixed
costs are measured on real windows by calibrate.py, with the prior's other parts known.)

Also the window runner the calibration times candidates with: rows sliced, moved to the
device, stepped, as the worker's window runs them."""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rayacc.config import TrainConfig
from rayacc.data.sources import DatasetInfo
from rayacc.engine import AccumulationStep, all_reduce, autocast_dtype, to_device
from rayacc.engine.autobatch import OUT_OF_MEMORY, measure_step_bytes
from rayacc.engine.collectives import all_gather_into, distributed, group_device
from rayacc.engine.recompute import apply_activation_checkpointing
from rayacc.engine.units import fsdp_blocks
from rayacc.models import loss_functions
from rayacc.models.registry import build_model
from rayacc.optim import build_optimizer, optimizer_slots

__all__ = ["Curve", "Profile", "largest_over_ranks", "measure_profile", "time_windows"]

REPEATS = 3
"""Timed repeats of each measurement at least (after one untimed); the median counts."""
MIN_TIMED_S = 0.3
MAX_REPEATS = 20


@dataclass
class Curve:
    """y(m) through measured points, linear between them and along the nearest segment beyond
    (a GPU's time per sample falls as the micro-batch fills it: one line would not fit)."""

    sizes: list[int]
    values: list[float]

    def at(self, m: float) -> float:
        xs, ys = self.sizes, self.values
        if len(xs) == 1:
            return ys[0] * m / xs[0]
        i = min(max(bisect.bisect_left(xs, m), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(0.0, y0 + (y1 - y0) * (m - x0) / (x1 - x0))


@dataclass
class Profile:
    """The measured parts of the prior (prior.py puts them together per candidate)."""

    device: str
    """`cpu` or `cuda`."""
    world: int
    """Ranks of the group that measured it."""
    param_bytes: int
    """The whole model's trainable parameters, as trained (fp32)."""
    units: int
    """Parts FSDP shards separately: the blocks, and the root."""
    largest_unit_bytes: int
    optimizer_slots: int
    compute_s: dict[str, Curve]
    """Activation checkpointing label → one forward + backward at micro-batch m (recomputation
    included: it is measured, not modelled)."""
    activation_bytes: dict[str, Curve]
    """Same keys → bytes a micro-batch of m adds to the parameters and gradients (CPU: what
    autograd saves; GPU: the allocator's peak)."""
    optimizer_s: float
    """One optimizer step over the whole model."""
    allreduce_s_per_byte: float = 0.0
    """All-reduce time per byte of the buffer, at `world` ranks (0 for one rank)."""
    gather_s_per_byte: float = 0.0
    """All-gather time per byte of the gathered output, at `world` ranks."""
    latency_s: float = 0.0
    """A one-value collective: the cost of each launch."""
    overheads: dict[str, list[float]] = field(default_factory=dict)
    """Strategy label → [per window, per micro-step]: what real windows of it (1 and 4
    micro-steps at the smallest size) take beyond the compute, communication and optimizer
    step the prior counts: slicing and moving rows, hooks, the window statistics, zeroing."""
    memory_bytes: int = 0
    """Memory one rank may plan for: the device's (GPU) or this node's RAM shared by its ranks
    (CPU)."""
    items_per_sample: float = 1.0
    """Loss items per sample (tokens for a token model)."""
    block_bytes: list[int] = field(default_factory=list)
    """Each block's parameters (the units activation checkpointing recomputes)."""
    failed: dict[str, int] = field(default_factory=dict)
    """Checkpointing label → smallest micro-batch that ran out of memory in the profile."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        d = dict(d)
        for key in ("compute_s", "activation_bytes"):
            d[key] = {k: Curve(**v) for k, v in d[key].items()}
        return cls(**d)


def checkpointing_every(label: str | int) -> int | None:
    return None if label == "none" else 1 if label == "full" else int(label)


def time_windows(
    step: AccumulationStep,
    loss_fn: Callable,
    count: Callable,
    rows,
    *,
    rank: int,
    micro: int,
    accum: int,
    device: torch.device,
    min_windows: int = 3,
    max_windows: int = 50,
    min_timed_s: float = 1.0,
) -> list[float]:
    """Wall times of timed windows of `accum` micro-batches of `micro` rows (this rank's slice
    of `rows`, repeated as needed): rows sliced and moved, then the step, as the worker's window
    runs them. One untimed window first; then as many as fill `min_timed_s` by the slowest
    rank's first (every rank runs the same count: each window's gradients sync)."""
    share = micro * accum
    index = np.resize(np.arange(len(rows)), share * (rank + 1))[rank * share :]

    def window() -> float:
        t0 = time.perf_counter()
        host = rows.take_split(index, [micro] * accum)
        local_items = sum(count(mb) for mb in host)
        batches = [to_device(mb, device, non_blocking=True) for mb in host]
        step(batches, loss_fn, count, local_items=local_items)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    (first,) = largest_over_ranks([window()])
    wanted = int(min(max(min_windows, min_timed_s / max(first, 1e-6)), max_windows))
    return [window() for _ in range(wanted)]


def _median_time(fn: Callable[[], Any], device: torch.device, *, fixed: bool = False) -> float:
    """Median wall time of `fn` after an untimed call: at least `REPEATS` timed calls, more
    until `MIN_TIMED_S` has passed (at most `MAX_REPEATS`: a millisecond step is noisy);
    `fixed`: exactly `REPEATS` (a collective: every rank must make the same calls)."""
    times: list[float] = []
    for i in range(1 + MAX_REPEATS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 1:
            times.append(time.perf_counter() - t0)
        if len(times) >= REPEATS and (fixed or sum(times) >= MIN_TIMED_S):
            break
    return statistics.median(times)


def _plain_model(cfg: TrainConfig, info: DatasetInfo, label: str | int, device: torch.device):
    model = build_model(cfg, info)
    every = checkpointing_every(label)
    if every is not None:
        apply_activation_checkpointing(fsdp_blocks(model), every)
    return model.to(device)


def largest_over_ranks(values: list[float]) -> list[float]:
    """Every rank's figures, each the largest over the ranks."""
    return all_reduce(torch.tensor(values, dtype=torch.float64), op="max").tolist()


def measure_profile(
    cfg: TrainConfig,
    info: DatasetInfo,
    rows,
    *,
    sizes: Sequence[int],
    checkpointings: Sequence[str | int],
    device: torch.device,
    rank: int,
    memory_bytes: int,
) -> Profile:
    """The profile of `cfg`'s model on this group (every rank calls it; every rank returns the
    same). `sizes`: micro-batches to measure at (the candidates' smallest to largest)."""
    precision = autocast_dtype(cfg.train.precision)
    # the objective's own count: the profile measures memory and time, not the step's scale
    loss_fn, count = loss_functions(info, cfg.train.loss_chunk_tokens, objective=cfg.train.loss)
    index = np.resize(np.arange(len(rows)), max(sizes) * (rank + 1))[rank * max(sizes) :]
    slots = optimizer_slots(cfg.optim)
    compute: dict[str, Curve] = {}
    acts: dict[str, Curve] = {}
    failed: dict[str, int] = {}
    param_bytes = units = largest = 0
    block_bytes: list[int] = []
    for label in checkpointings:
        model = _plain_model(cfg, info, label, device)
        params = [p for p in model.parameters() if p.requires_grad]
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        blocks = fsdp_blocks(model)
        units = len(blocks) + 1
        block_bytes = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks]
        largest = max([param_bytes - sum(block_bytes), *block_bytes])

        def fwd_bwd(batch, model=model):
            with torch.autocast(device.type, dtype=precision, enabled=precision is not None):
                loss_fn(model, batch).float().sum().backward()
            model.zero_grad(set_to_none=True)

        # the first calls of a process pay its thread pools, allocator and kernels' set-up:
        # paid here, at the largest size, not by the first size measured
        warm = to_device(rows.take(index[: max(sizes)]), device)
        if (
            measure_step_bytes(model, loss_fn, warm, autocast_dtype=precision, optimizer_slots=0)
            != OUT_OF_MEMORY
        ):
            fwd_bwd(warm)
            fwd_bwd(warm)
        times, used = [], []
        for m in sizes:
            batch = to_device(rows.take(index[:m]), device)
            total = measure_step_bytes(
                model, loss_fn, batch, autocast_dtype=precision, optimizer_slots=0
            )
            if total == OUT_OF_MEMORY:
                times.append(float("inf"))
                used.append(float("inf"))
                continue
            times.append(_median_time(lambda batch=batch: fwd_bwd(batch), device))
            used.append(float(total - 2 * param_bytes))
        times, used = largest_over_ranks(times), largest_over_ranks(used)
        ok = [i for i, t in enumerate(times) if t != float("inf")]
        if len(ok) < len(sizes):
            failed[str(label)] = sizes[len(ok)]
        if ok:
            compute[str(label)] = Curve([sizes[i] for i in ok], [times[i] for i in ok])
            acts[str(label)] = Curve([sizes[i] for i in ok], [used[i] for i in ok])
        del model
    # the optimizer over the whole model, gradients in place
    model = _plain_model(cfg, info, "none", device)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer = build_optimizer(cfg.optim, model.parameters(), 1e-6, device)
    optimizer_s = _median_time(optimizer.step, device)
    del model, optimizer
    per_byte, gather, latency = _collectives(param_bytes)
    items = count(rows.take(index[: max(sizes)])) / max(sizes)
    profile = Profile(
        device=device.type,
        world=dist.get_world_size() if distributed() else 1,
        param_bytes=param_bytes,
        units=units,
        largest_unit_bytes=largest,
        block_bytes=block_bytes,
        optimizer_slots=slots,
        compute_s=compute,
        activation_bytes=acts,
        optimizer_s=largest_over_ranks([optimizer_s])[0],
        allreduce_s_per_byte=per_byte,
        gather_s_per_byte=gather,
        latency_s=latency,
        memory_bytes=memory_bytes,
        items_per_sample=float(items),
        failed=failed,
    )
    return profile


def _collectives(param_bytes: int) -> tuple[float, float, float]:
    """(all-reduce s/byte, all-gather s/byte of output, latency s) on this group; zeros for
    one rank. The buffer is the model's size (at most 64 MiB: the rate is flat beyond)."""
    if not distributed():
        return 0.0, 0.0, 0.0
    world, device = dist.get_world_size(), group_device()
    n = max(world, min(param_bytes, 64 << 20) // 4 // world * world)
    buf = torch.zeros(n, device=device)
    part = torch.zeros(n // world, device=device)
    one = torch.zeros(1, device=device)
    t_ar = _median_time(lambda: all_reduce(buf), device, fixed=True)
    t_ag = _median_time(lambda: all_gather_into(buf, part), device, fixed=True)
    t_one = _median_time(lambda: all_reduce(one), device, fixed=True)
    t_ar, t_ag, t_one = largest_over_ranks([t_ar, t_ag, t_one])
    return max(t_ar - t_one, 0.0) / (4 * n), max(t_ag - t_one, 0.0) / (4 * n), t_one
