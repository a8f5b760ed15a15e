from __future__ import annotations

from typing import Any

from rayacc.config import TrainConfig
from rayacc.config.batch_plan import BatchPlan


def contract_params(cfg: TrainConfig, plan: BatchPlan, effective_lr: float) -> dict[str, Any]:
    """The resolved values every run records (docs/design.md), plus the whole config as dotted
    keys."""
    params: dict[str, Any] = dict(cfg.flat())
    params.update(
        micro_batch_size=plan.micro_batch_size,
        grad_accum_steps=plan.grad_accum_steps,
        num_workers=plan.num_workers,
        global_batch_size=plan.global_batch_size,
        base_lr=cfg.optim.lr,
        base_batch_size=cfg.optim.base_batch_size or plan.global_batch_size,
        lr_scaling=cfg.optim.lr_scaling,
        effective_lr=effective_lr,
    )
    return params
