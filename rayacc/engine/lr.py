"""LR scaling rules and schedules. Schedules count optimizer steps, not micro-steps."""

from __future__ import annotations

import math

import torch

__all__ = ["LR_RULES", "build_scheduler", "effective_lr", "lr_multiplier"]

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
    step: int,
    *,
    warmup_steps: int,
    total_steps: int | None,
    schedule: str = "cosine",
    min_lr_ratio: float = 0.0,
) -> float:
    """Multiplier of the effective LR at optimizer step `step` (0-based).

    Linear warmup reaches 1 at step `warmup_steps - 1`; cosine then decays to `min_lr_ratio` at the
    last step (`total_steps - 1`); constant stays at 1. Without `total_steps` cosine is constant.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
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
