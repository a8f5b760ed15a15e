"""DDP's gradient all-reduce, counted: the comm hook that sums gradients over ranks and carries
the window's statistics with them (when to sync is the strategy's: engine/parallel/)."""

import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from rayacc.engine.collectives import all_reduce_async
from rayacc.engine.noise import LocalGradients
from rayacc.engine.units import is_ddp

__all__ = [
    "CommCounter",
    "install_comm_counter",
    "is_ddp",
]


@dataclass
class CommCounter:
    """Counts gradient all-reduce launches (one per DDP bucket) and passes (one per synced
    backward), and the wall time from a pass's first launch to its last completion.

    It also carries the window's statistics (loss sum, item counts) to the other ranks: a small
    tensor attached before the syncing backward rides along in the first gradient bucket's
    all-reduce (appended to it in a buffer kept between windows; a bucket in a dtype that cannot
    hold the counts exactly gets a separate all-reduce launched right behind it instead). A
    separate all-reduce before or after the backward would add a point where every rank waits
    for the slowest (measured on 2 CPU ranks: +2.2 ms before, +0.7 ms after, on an 8 ms step).

    More: docs/design.md, "Notes from the code" (engine/sync.py: CommCounter).
    """

    average: bool = True
    world_size: int = 1
    launches: int = 0
    passes: int = 0
    _pass_start: float | None = None
    _last_done: float | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _stats: torch.Tensor | None = field(default=None, repr=False)
    _stats_exact_in_fp32: bool = False
    _stats_work: dist.Work | None = field(default=None, repr=False)
    _reduced: torch.Tensor | None = field(default=None, repr=False)
    _riding: torch.Tensor | None = field(default=None, repr=False)
    local: LocalGradients = field(default_factory=LocalGradients, repr=False)
    """Each bucket's gradient sum before it is reduced (the noise scale's small batches)."""

    def begin_window(self) -> None:
        self.launches = 0
        self.passes = 0
        self._pass_start = None
        self._last_done = None
        self._stats = None
        self._stats_work = None
        self._reduced = None

    def attach_window_stats(self, stats: torch.Tensor, exact_in_fp32: bool) -> None:
        """`stats` is summed over the ranks during the next synced backward. `exact_in_fp32`:
        its sums stay exact in float32 (whole numbers below 2**24, or values only logged)."""
        self._stats = stats
        self._stats_exact_in_fp32 = exact_in_fp32
        self._stats_work = None
        self._reduced = None

    def reduced_window_stats(self) -> torch.Tensor | None:
        """The attached stats summed over all ranks, or None when no synced backward ran."""
        if self._stats_work is not None:
            self._stats_work.wait()
            self._stats_work = None
        return self._reduced

    def _take_stats(self, dtype: torch.dtype) -> tuple[torch.Tensor | None, bool]:
        """The attached stats (once per pass) and whether they can ride in a bucket of dtype."""
        stats, self._stats = self._stats, None
        fits = dtype == torch.float64 or (dtype == torch.float32 and self._stats_exact_in_fp32)
        return stats, fits

    def _riding_buffer(self, like: torch.Tensor, numel: int) -> torch.Tensor:
        """A buffer for bucket + stats, kept between windows and made again only when a
        larger one is needed: a fresh one costs an allocation the size of the bucket (page
        faults on CPU), and the stats' length changes (a group's first window carries no rank
        figures)."""
        buf = self._riding
        same = buf is not None and (buf.dtype, buf.device) == (like.dtype, like.device)
        if not same or buf.numel() < numel:
            buf = self._riding = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel]

    def sync_time_s(self) -> float:
        if self._pass_start is None or self._last_done is None:
            return 0.0
        return max(0.0, self._last_done - self._pass_start)

    def _on_launch(self, bucket_index: int) -> None:
        now = time.perf_counter()
        with self._lock:
            self.launches += 1
            # DDP reduces every bucket once per synced backward; bucket 0 stands for the pass
            if bucket_index == 0:
                self.passes += 1
            if self._pass_start is None:
                self._pass_start = now

    def _on_done(self) -> None:
        now = time.perf_counter()
        with self._lock:
            self._last_done = now


# no `from __future__ import annotations` in this module: DDP inspects the hook's annotations
# and rejects string ones; it also rejects lambdas, so the hook is a plain function
def _counting_allreduce_hook(
    state: tuple[CommCounter, dist.ProcessGroup | None], bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    counter, group = state
    counter._on_launch(bucket.index())
    grads = bucket.buffer()
    counter.local.observe(grads)
    if counter.average and counter.world_size > 1:
        grads.div_(counter.world_size)
    stats, fits = counter._take_stats(grads.dtype) if bucket.index() == 0 else (None, False)
    if stats is not None and fits:
        # the window's stats ride in this bucket's all-reduce: no collective of their own
        n = grads.numel()
        combined = counter._riding_buffer(grads, n + stats.numel())
        combined[:n].copy_(grads)
        combined[n:].copy_(stats)
        fut = all_reduce_async(combined, group).get_future()

        def split(f):
            out = f.value()[0]
            # a copy: the buffer is reused by the next window
            counter._reduced = out[n:].to(stats.dtype, copy=True)
            counter._on_done()
            return out[:n]

        return fut.then(split)

    fut = all_reduce_async(grads, group).get_future()
    if stats is not None:
        # every rank launches its collectives in this same order (DDP launches buckets by index)
        # reduced in place: valid once the work is waited for
        counter._stats_work = all_reduce_async(stats, group)
        counter._reduced = stats

    def done(f):
        counter._on_done()
        return f.value()[0]

    return fut.then(done)


def install_comm_counter(model: nn.Module, average: bool = True) -> "CommCounter | None":
    """Registers the counting all-reduce hook on a DDP model: DDP's arithmetic (the mean over
    ranks), or with `average=False` the sum over ranks.

    Returns None for a model that is not DDP (nothing to sync). DDP accepts one comm hook per model
    and only before the first forward; a model that already has one raises there.
    """
    if not is_ddp(model):
        return None
    counter = CommCounter(average=average, world_size=dist.get_world_size(model.process_group))
    model.register_comm_hook((counter, model.process_group), _counting_allreduce_hook)
    return counter
