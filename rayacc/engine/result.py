"""What one accumulation step did (engine/step.py): the step's loss and counts, the gradient's
norm, whether it was skipped and why, its time and its parts, the window's signals and every
rank's figures."""

from __future__ import annotations

from dataclasses import dataclass

from rayacc.engine.parallel.base import GroupCalls, PipelineStats

__all__ = ["StepResult"]


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did, identical on every rank unless noted."""

    loss: float
    """Exact mean item loss of the window over all ranks (nan when the loss was not finite)."""
    items: int
    """Loss items in the window on all ranks (N_window)."""
    samples: int
    """Samples (rows) in the window on all ranks."""
    micro_steps: int
    """Micro-steps each rank ran."""
    grad_norm: float
    """Global gradient norm after unscaling, before clipping (nan when skipped before it)."""
    lr: float
    """Learning rate this step used (of the first param group)."""
    skipped: bool
    """True when the optimizer did not step (non-finite loss or gradient, or fp16 overflow)."""
    skip_reason: str | None
    allreduce_calls: int
    """Gradient all-reduce launches (DDP buckets) in the window; 0 without DDP."""
    reduce_scatter_calls: int
    """FSDP: gradient reduce-scatter launches (one per FSDP unit and synced backward); DeepSpeed
    ZeRO-2/3: its gradient reduce-scatters."""
    sync_passes: int
    """Backward passes that synced gradients (1 with accumulation done right)."""
    step_time_s: float
    """Wall time of the whole window."""
    sync_time_s: float
    """Wall time from the window's first gradient collective (all-reduce or reduce-scatter)
    launched to the last one's completion (it overlaps the backward's compute)."""
    peak_memory_mb: float
    """This rank: peak allocated device memory in the window on GPU; on CPU the process's peak
    resident set size so far."""
    micro_batch_splits: int = 1
    """Each given micro-batch was cut into this many (doubled by every out-of-memory retry)."""
    signals: int = 0
    """Ranks that raised the caller's `signal` for this window: a notice one rank has that
    every rank learns in the same window, summed with the window's counts (no collective of
    its own)."""
    optimizer_time_s: float = 0.0
    """This rank: unscale, normalise, clip, step and schedule."""
    group_figures: tuple[float, ...] = ()
    """Every rank's `rank_figures` given for this window, flat in rank order (the same on
    every rank; rank r's at [r·k, (r+1)·k) for reports of k figures): each rank's figures
    summed into its own slots of the window's counts, so they travel with the gradient
    reduction (no collective of their own)."""
    rank_width: int = 0
    """k: figures in each rank's report (0: none given)."""
    all_gather_calls: int = 0
    """ZeRO-3: parameter all-gathers in the window (its forwards and backwards)."""
    noise: tuple[float, float] | None = None
    """The window before's gradient noise: (tr Σ, |G|²) estimated from each rank's gradient
    as the reduction took it (engine/noise.py); None where not measured."""
    tensor_parallel_calls: GroupCalls | None = None
    """The tensor-parallel group's collectives in the window (None without it)."""
    pipeline: PipelineStats | None = None
    """This rank's pipeline stage in the window: sends, idle time (None without a pipeline)."""

    @property
    def figures_by_rank(self) -> tuple[tuple[float, ...], ...]:
        """`group_figures` cut into one report per rank (cut only when asked: the ranks that
        do not read them pay nothing)."""
        f, k = self.group_figures, self.rank_width
        return tuple(f[i : i + k] for i in range(0, len(f), k)) if k else ()

    @property
    def compute_time_s(self) -> float:
        return max(0.0, self.step_time_s - self.sync_time_s)

    @property
    def sync_time_frac(self) -> float:
        return self.sync_time_s / self.step_time_s if self.step_time_s > 0 else 0.0
