from __future__ import annotations

from typing import Any

from rayacc.config import TrainConfig
from rayacc.config.batch_split import BatchSplit


def contract_params(cfg: TrainConfig, split: BatchSplit, effective_lr: float) -> dict[str, Any]:
    """The resolved values every run records (docs/design.md), plus the whole config as dotted
    keys."""
    params: dict[str, Any] = dict(cfg.flat())
    params.update(
        micro_batch_size=split.micro_batch_size,
        grad_accum_steps=split.grad_accum_steps,
        num_workers=split.num_workers,
        global_batch_size=split.global_batch_size,
        base_lr=cfg.optim.lr,
        base_batch_size=cfg.optim.base_batch_size or split.global_batch_size,
        lr_scaling=cfg.optim.lr_scaling,
        effective_lr=effective_lr,
    )
    return params
