"""The model of a run as its ranks hold it under `train.strategy: fsdp`, and activation
checkpointing for either strategy."""

from __future__ import annotations

import torch
from torch import nn

from rayacc.config import TrainConfig
from rayacc.data.sources import DatasetInfo
from rayacc.engine.recompute import apply_activation_checkpointing
from rayacc.engine.units import fsdp_blocks
from rayacc.models.init import initial_values, seeds_parameters
from rayacc.models.registry import build_model, build_on_meta

__all__ = ["build_sharded", "checkpoint_activations"]


def checkpoint_activations(cfg: TrainConfig, module: nn.Module) -> None:
    """`train.activation_checkpointing`: recompute the chosen blocks in backward."""
    setting = cfg.train.activation_checkpointing
    if setting == "none":
        return
    blocks = fsdp_blocks(module)
    if blocks:  # none: `prepare` has warned
        apply_activation_checkpointing(blocks, 1 if setting == "full" else setting.every_n)


def build_sharded(cfg: TrainConfig, info: DatasetInfo, device: torch.device) -> nn.Module:
    """The model sharded with FSDP2 over the process group (a collective). A model that seeds
    its parameters (models/init.py; the built-in `gpt`) is built on the meta device and each
    rank materialises only its shards, one parameter whole at a time at most; any other is
    built whole on every rank from the seed, then sharded. Either way the full weights are
    `build_model(cfg)`'s, for any number of ranks."""
    from rayacc.engine.fsdp import materialize_shards, shard_model

    module = build_on_meta(cfg, info)
    on_meta = any(p.is_meta for p in module.parameters())
    if on_meta and not seeds_parameters(module):
        module = build_model(cfg, info)
        on_meta = False
    checkpoint_activations(cfg, module)
    if cfg.train.compile:
        # each block compiled in place before it is sharded (names, and so checkpoints, stay):
        # FSDP's gathers and reduce-scatters run between the compiled blocks
        for block in fsdp_blocks(module):
            block.compile()
    shard_model(
        module if on_meta else module.to(device),
        device=device,
        reshard_after_forward=cfg.fsdp.reshard_after_forward,
        param_dtype=torch.bfloat16
        if cfg.train.precision == "bf16" and cfg.fsdp.mixed_precision
        else None,
    )
    if on_meta:
        materialize_shards(module, device, initial_values(module, cfg.seed))
    return module
