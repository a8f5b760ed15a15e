"""What a run tells its observers: typed events, and per-step records.

Rank 0 of the worker group sends them to the driver in order; the driver hands each to every
observer (the console, MLflow, the run's history). A step record is a plain mapping of metric
name → value with `step` (the optimizer step, 1-based); everything else is an event below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Event",
    "MicroBatchChanged",
    "Resized",
    "RunObserver",
    "RunStarted",
    "ScheduleChanged",
]


@dataclass(frozen=True)
class RunStarted:
    """A worker group started (the first time, or again after a failure or a resize)."""

    step: int
    """Optimizer steps already done (0 on a fresh run)."""
    total_steps: int
    resumed_from: int | None
    """The checkpoint's step when the group restored one."""
    layout: str
    """How the epoch splits into windows."""
    plan: dict[str, int]
    """The batch plan this group runs (BatchPlan fields)."""
    effective_lr: float

    def describe(self) -> str | None:
        if self.resumed_from is None:
            return None
        return f"resumed from the checkpoint at step {self.resumed_from}"


@dataclass(frozen=True)
class Resized:
    """An elastic run restarted at another worker count."""

    step: int
    policy: str
    old_workers: int
    new_workers: int
    old_grad_accum_steps: int | None
    new_grad_accum_steps: int
    old_global_batch_size: int
    new_global_batch_size: int
    effective_lr: float

    def describe(self) -> str:
        """The line kept in the run's `rayacc.resizes` tag."""
        return (
            f"step {self.step}: workers {self.old_workers}→{self.new_workers}, accum "
            f"{self.old_grad_accum_steps}→{self.new_grad_accum_steps}, global "
            f"{self.old_global_batch_size}→{self.new_global_batch_size}"
        )

    def console_line(self) -> str:
        return (
            f"resize at step {self.step}: workers {self.old_workers} → {self.new_workers}, "
            f"accumulation {self.old_grad_accum_steps} → {self.new_grad_accum_steps}, global "
            f"batch {self.old_global_batch_size} → {self.new_global_batch_size}, effective LR "
            f"{self.effective_lr:.6g}"
        )


@dataclass(frozen=True)
class MicroBatchChanged:
    """The micro-batch (and so the accumulation) changed: chosen by the auto search, or cut by
    an out-of-memory retry. The global batch stays."""

    step: int
    """Optimizer steps done before the change; it applies from step + 1."""
    micro_batch_size: int
    grad_accum_steps: int
    reason: str
    """`auto search` or `out of memory`."""
    budget_mb: float | None = None
    trials: tuple[tuple[int, bool], ...] = field(default_factory=tuple)
    """Sizes the search tried, each with whether it fitted."""
    out_of_memory: tuple[int, ...] = ()
    """Sizes the search tried that ran out of device memory."""

    def describe(self) -> str:
        """The line kept in the run's `rayacc.micro_batch_events` tag."""
        return (
            f"step {self.step}: micro {self.micro_batch_size} × accum {self.grad_accum_steps} "
            f"({self.reason})"
        )

    def console_line(self) -> str:
        tried = ", ".join(f"{m}{'✓' if ok else '✗'}" for m, ok in self.trials)
        oom = ", ".join(map(str, self.out_of_memory))
        return (
            f"micro-batch {self.micro_batch_size} × accumulation {self.grad_accum_steps} from "
            f"step {self.step + 1} ({self.reason}{'; tried ' + tried if tried else ''}"
            f"{'; out of memory at ' + oom if oom else ''})"
        )


@dataclass(frozen=True)
class ScheduleChanged:
    """A resume changed the run's length (`train.max_steps`, `train.epochs`): the LR goes on
    from where it was, and the rest of its decay is re-planned over the new length."""

    step: int
    old_length: float | None
    """The schedule's length in steps of the reference global batch, before and after."""
    new_length: float | None
    lr: float
    """The LR the next step runs at (the one the checkpoint's step ran at)."""

    def describe(self) -> str:
        """The line kept in the run's `rayacc.schedule_changes` tag."""
        return (
            f"step {self.step}: length {_steps(self.old_length)}→{_steps(self.new_length)}, "
            f"LR {self.lr:.6g} decays from there"
        )

    def console_line(self) -> str:
        return (
            f"schedule re-planned at step {self.step}: the run's length changed from "
            f"{_steps(self.old_length)} to {_steps(self.new_length)} steps; the LR goes on from "
            f"{self.lr:.6g} (no warmup again) and decays to the end of the new length"
        )


def _steps(length: float | None) -> str:
    return "open-ended" if length is None else f"{length:g}"


Event = RunStarted | Resized | MicroBatchChanged | ScheduleChanged


class RunObserver:
    """Sees a run's events and step records in order, on the driver. Subclasses override what
    they use; the console and MLflow are two such observers."""

    def on_event(self, event: Event) -> None:
        """An event (see `Event`)."""

    def on_step(self, record: dict[str, Any]) -> None:
        """The metrics of one optimizer step (`step` and metric name → value)."""
