"""A run's MLflow params: the contract's resolved values first (shared/design.md), then the
config as dotted keys — only the sections that apply to the run (its strategy's, its model
kind's), and none that repeats a contract param under another name."""

from __future__ import annotations

from typing import Any

from rayacc.config import TrainConfig
from rayacc.config.batch_split import BatchSplit
from rayacc.config.strategies import strategy_sections

__all__ = ["MODEL_KEYS", "contract_params"]

MODEL_KEYS = {
    "mlp": ("hidden_sizes", "dropout"),
    "gpt": ("n_layer", "n_head", "n_embd", "block_size", "dropout", "lora"),
    "factory": ("factory", "kwargs", "dropout", "lora"),
    "hf": ("hf", "lora"),
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


CONTRACT_FIELDS = {
    "batch.micro_batch_size": "micro_batch_size",
    "batch.grad_accum_steps": "grad_accum_steps",
    "batch.global_batch_size": "global_batch_size",
    "optim.lr": "base_lr",
    "optim.base_batch_size": "base_batch_size",
    "optim.lr_scaling": "lr_scaling",
}
"""The config's keys whose resolved value is a contract param: recorded once, by the contract's
name (a setting that is not the value, `batch.micro_batch_size: auto`, stays beside it)."""

FIRST_KEYS = ("train.strategy", "model.name")
"""What a reader looks for after the batch arithmetic: the config keys recorded next."""


def contract_params(cfg: TrainConfig, split: BatchSplit, effective_lr: float) -> dict[str, Any]:
    """The resolved values every run records, in the contract's order, then the config's keys
    that apply to the run (MLflow's run page lists params in the order they were logged)."""
    params: dict[str, Any] = {
        "micro_batch_size": split.micro_batch_size,
        "grad_accum_steps": split.grad_accum_steps,
        "num_workers": split.num_workers,
        **({"data_parallel_size": split.data_parallel} if split.model_parallel > 1 else {}),
        "global_batch_size": split.global_batch_size,
        "base_lr": cfg.optim.lr,
        "base_batch_size": cfg.optim.base_batch_size or split.global_batch_size,
        "lr_scaling": cfg.optim.lr_scaling,
        "effective_lr": effective_lr,
    }
    strategy, model = cfg.train.strategy, cfg.model.name
    flat = cfg.flat()
    for key in (*FIRST_KEYS, *flat):
        if key in params or not _applies(key, strategy, model):
            continue
        if key in CONTRACT_FIELDS and not (key == "batch.micro_batch_size" and flat[key] == "auto"):
            continue
        params[key] = flat[key]
    return params
