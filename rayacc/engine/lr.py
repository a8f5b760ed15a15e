"""LR scaling rules and schedules, never counted in micro-steps: `build_scheduler` counts
optimizer steps; `SampleSchedule`, which training and `verify` use, counts samples in units of a
reference global batch, so an elastic run's LR does not jump when its global batch changes."""

from __future__ import annotations

import math

import torch

__all__ = ["LR_RULES", "SampleSchedule", "build_scheduler", "effective_lr", "lr_multiplier"]

LR_RULES = ("linear", "sqrt", "none")


def effective_lr(
    base_lr: float, global_batch_size: int, base_batch_size: int | None, rule: str
) -> float:
    """`base_lr × f(global / base)`, f(r) = r (linear), √r (sqrt) or 1 (none).

    `base_batch_size=None` means the LR was tuned at this global batch: the ratio is 1.
    """
    if rule not in LR_RULES:
        raise ValueError(f"optim.lr_scaling={rule!r} is not one of {', '.join(LR_RULES)}")
    if base_lr <= 0:
        raise ValueError(f"optim.lr must be > 0, got {base_lr}")
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
    if base_batch_size is not None and base_batch_size < 1:
        raise ValueError(f"optim.base_batch_size must be >= 1, got {base_batch_size}")
    ratio = 1.0 if base_batch_size is None else global_batch_size / base_batch_size
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    return base_lr


def lr_multiplier(
    step: float,
    *,
    warmup_steps: int,
    total_steps: float | None,
    schedule: str = "cosine",
    min_lr_ratio: float = 0.0,
) -> float:
    """Multiplier of the effective LR at optimizer step `step` (0-based).

    Linear warmup reaches 1 at step `warmup_steps - 1`; cosine then decays to `min_lr_ratio` at the
    last step (`total_steps - 1`); constant stays at 1. Without `total_steps` cosine is constant.
    A fractional step (a short window's sample position) between the two holds at 1: the peak
    is never passed.
    """
    if step < warmup_steps:
        return min(1.0, (step + 1) / warmup_steps)
    if schedule == "constant" or total_steps is None:
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"optim.schedule={schedule!r} is not one of cosine, constant")
    decay_steps = total_steps - 1 - warmup_steps
    if decay_steps <= 0:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int,
    total_steps: int | None,
    schedule: str = "cosine",
    min_lr_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over the optimizer's current LRs (set them to the effective LR first)."""

    def fn(step: int) -> float:
        return lr_multiplier(
            step,
            warmup_steps=warmup_steps,
            total_steps=total_steps,
            schedule=schedule,
            min_lr_ratio=min_lr_ratio,
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


class SampleSchedule:
    """The LR schedule counted in samples, so it does not jump when the global batch changes.

    Position = samples of applied steps / `reference_batch` (the global batch the schedule was
    planned for), fed to `lr_multiplier`; LR = peak × multiplier. `set_peak` moves to a new peak
    LR (a resize under keep_micro_batch) linearly over `rewarm_steps` applied steps. Call `step`
    once per applied optimizer step; skipped steps do not advance it. `total_steps` is in the
    same units: the sample position of the last step / `reference_batch`, plus one (fractional
    when a short window ends an epoch), so the schedule ends exactly at the last step.

    More: docs/design.md, "Notes from the code" (engine/lr.py: SampleSchedule).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        peak_lr: float,
        reference_batch: int,
        warmup_steps: int,
        total_steps: float | None,
        schedule: str = "cosine",
        min_lr_ratio: float = 0.0,
    ):
        self.optimizer = optimizer
        self.reference_batch = reference_batch
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.schedule = schedule
        self.min_lr_ratio = min_lr_ratio
        self.samples = 0
        self.peak_lr = peak_lr
        self.ramp_from = peak_lr
        self.ramp_steps = 0
        self.ramp_done = 0
        self.replan_at: float | None = None
        self.replan_from = 1.0
        self.replanned: tuple[float | None, float | None, float] | None = None
        """(old total, new total, LR) when `load_state_dict` re-planned the decay."""
        self.apply()

    def current_peak(self) -> float:
        if self.ramp_done >= self.ramp_steps:
            return self.peak_lr
        frac = self.ramp_done / self.ramp_steps
        return self.ramp_from + (self.peak_lr - self.ramp_from) * frac

    @property
    def position(self) -> float:
        return self.samples / self.reference_batch

    def multiplier(self, position: float) -> float:
        if self.replan_at is None or position < self.replan_at:
            return lr_multiplier(
                position,
                warmup_steps=self.warmup_steps,
                total_steps=self.total_steps,
                schedule=self.schedule,
                min_lr_ratio=self.min_lr_ratio,
            )
        span = (self.total_steps or 0) - 1 - self.replan_at
        if span <= 0:
            return self.replan_from
        progress = min(1.0, (position - self.replan_at) / span)
        low = self.min_lr_ratio
        return low + (self.replan_from - low) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def lr(self) -> float:
        return self.current_peak() * self.multiplier(self.position)

    def apply(self) -> None:
        lr = self.lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def set_peak(self, peak_lr: float, rewarm_steps: int) -> None:
        if peak_lr == self.peak_lr:
            return
        self.ramp_from = self.current_peak()
        self.peak_lr = peak_lr
        self.ramp_steps = rewarm_steps
        self.ramp_done = 0
        self.apply()

    def step(self, samples: int) -> None:
        self.samples += samples
        self.ramp_done += 1
        self.apply()

    def state_dict(self) -> dict[str, float]:
        return {
            "samples": self.samples,
            "peak_lr": self.peak_lr,
            "ramp_from": self.ramp_from,
            "ramp_steps": self.ramp_steps,
            "ramp_done": self.ramp_done,
            "total_steps": self.total_steps,
            "replan_at": self.replan_at,
            "replan_from": self.replan_from,
        }

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.samples = int(state["samples"])
        self.peak_lr = float(state["peak_lr"])
        self.ramp_from = float(state["ramp_from"])
        self.ramp_steps = int(state["ramp_steps"])
        self.ramp_done = int(state["ramp_done"])
        planned = self.total_steps
        # a state from before the length was saved: taken as planned for this length
        self.total_steps = state.get("total_steps", planned)
        self.replan_at = state.get("replan_at")
        self.replan_from = float(state.get("replan_from", 1.0))
        if self.total_steps != planned:
            before = self.total_steps
            decaying = self.schedule != "constant" and self.position >= self.warmup_steps
            if decaying:
                self.replan_from = self.multiplier(self.position)
                self.replan_at = self.position
            self.total_steps = planned
            self.replanned = (before, planned, self.lr()) if decaying else None
        self.apply()
