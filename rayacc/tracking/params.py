"""A run's MLflow params: the contract's resolved values (shared/design.md), then the config as
dotted keys — only the sections that apply to the run (its strategy's, its model kind's), and
what the config left to derivation given as derived (`batch.grad_accum_steps: 4`, not null)."""

from __future__ import annotations

from typing import Any

from rayacc.config import TrainConfig
from rayacc.config.batch_split import BatchSplit
from rayacc.config.strategies import strategy_sections

__all__ = ["MODEL_KEYS", "contract_params"]

MODEL_KEYS = {
    "mlp": ("hidden_sizes", "dropout"),
    "gpt": ("n_layer", "n_head", "n_embd", "block_size", "dropout"),
    "factory": ("factory", "kwargs", "dropout"),
    "hf": ("hf",),
}
"""The `model.*` keys each model kind reads (`model.name` is always recorded)."""


def _applies(key: str, strategy: str, model: str) -> bool:
    section, _, rest = key.partition(".")
    owner = strategy_sections().get(section)
    if owner is not None:
        return owner == strategy
    if section == "model" and rest != "name":
        return rest.split(".", 1)[0] in MODEL_KEYS[model]
    return True


def contract_params(cfg: TrainConfig, split: BatchSplit, effective_lr: float) -> dict[str, Any]:
    """The resolved values every run records, then the config's keys that apply to it."""
    strategy, model = cfg.train.strategy, cfg.model.name
    params: dict[str, Any] = {k: v for k, v in cfg.flat().items() if _applies(k, strategy, model)}
    # what the config left null, as it was derived for this run
    derived = {
        "batch.global_batch_size": split.global_batch_size,
        "batch.micro_batch_size": split.micro_batch_size,
        "batch.grad_accum_steps": split.grad_accum_steps,
        "optim.base_batch_size": cfg.optim.base_batch_size or split.global_batch_size,
    }
    if cfg.batch.auto_micro_batch:
        # the search decides them once the workers run (logged from its event)
        del derived["batch.micro_batch_size"], derived["batch.grad_accum_steps"]
    params.update({k: v for k, v in derived.items() if params.get(k) is None})
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
