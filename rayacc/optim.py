"""The optimizer and the LR schedule of a config: training and `verify` build theirs here."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rayacc.config import TrainConfig
from rayacc.engine import SampleSchedule

__all__ = ["build_optimizer", "build_schedule"]


def build_optimizer(
    cfg: TrainConfig, params: Iterable[torch.nn.Parameter], lr: float, device: torch.device
) -> torch.optim.Optimizer:
    o = cfg.optim
    # one kernel per parameter instead of several per tensor: PyTorch's fused kernels exist
    # for CPU and CUDA (on a small CPU model AdamW's step takes a third of the per-tensor loop)
    fused = o.fused if o.fused is not None else device.type in ("cpu", "cuda")
    if o.name == "sgd":
        # the fused SGD kernel has no rule for sharded (DTensor) parameters
        fused = fused and cfg.train.strategy != "fsdp"
        return torch.optim.SGD(
            params, lr=lr, momentum=o.momentum, weight_decay=o.weight_decay, fused=fused or None
        )
    return torch.optim.AdamW(
        params, lr=lr, betas=o.betas, weight_decay=o.weight_decay, fused=fused or None
    )


def build_schedule(
    cfg: TrainConfig,
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
        warmup_steps=cfg.optim.warmup_steps,
        total_steps=total_steps,
        schedule=cfg.optim.schedule,
        min_lr_ratio=cfg.optim.min_lr_ratio,
    )
