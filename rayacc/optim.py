"""The optimizer and the LR schedule of a config: training and `verify` build theirs here."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rayacc.config import OptimConfig
from rayacc.config.strategies import ADAM_FAMILY
from rayacc.engine import SampleSchedule, Strategy

__all__ = ["build_optimizer", "build_schedule", "optimizer_slots"]


def optimizer_slots(optim: OptimConfig) -> int:
    """Values the optimizer keeps per parameter: Adam and AdamW 2 (both moments), SGD 1 with
    momentum."""
    return 2 if optim.name in ADAM_FAMILY else int(optim.momentum > 0)


def build_optimizer(
    optim: OptimConfig,
    params: Iterable[torch.nn.Parameter],
    lr: float,
    device: torch.device,
    strategy: Strategy | None = None,
) -> torch.optim.Optimizer:
    """`strategy`: the one holding `params` (some fused kernels cannot step its parameters)."""
    o = optim
    # one kernel per parameter instead of several per tensor: PyTorch's fused kernels exist
    # for CPU and CUDA (on a small CPU model AdamW's step takes a third of the per-tensor loop)
    fused = o.fused if o.fused is not None else device.type in ("cpu", "cuda")
    if o.name == "sgd":
        fused = fused and (strategy is None or strategy.contract.fused_sgd)
        return torch.optim.SGD(
            params, lr=lr, momentum=o.momentum, weight_decay=o.weight_decay, fused=fused or None
        )
    adam = torch.optim.Adam if o.name == "adam" else torch.optim.AdamW
    return adam(params, lr=lr, betas=o.betas, weight_decay=o.weight_decay, fused=fused or None)


def build_schedule(
    optim: OptimConfig,
    optimizer: torch.optim.Optimizer,
    *,
    peak_lr: float,
    reference_batch: int,
    total_steps: float,
) -> SampleSchedule:
    """The LR schedule, counted in samples of `reference_batch` (the global batch the run's
    steps were planned for), so it does not jump when an elastic run changes the batch.
    `total_steps`: `quantities.schedule_length`, fractional when a short window ends an epoch."""
    return SampleSchedule(
        optimizer,
        peak_lr=peak_lr,
        reference_batch=reference_batch,
        warmup_steps=optim.warmup_steps,
        total_steps=total_steps,
        schedule=optim.schedule,
        min_lr_ratio=optim.min_lr_ratio,
    )
