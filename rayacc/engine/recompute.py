"""Activation checkpointing: a block's activations are recomputed in backward instead of kept
from forward, trading about one more forward of compute for the block's saved activations.

Applied per block by replacing the block's `forward` with a checkpointed call of the same
function, so parameter names (and so checkpoints and state dicts) do not change, and DDP's and
FSDP's module hooks still run around the block."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["apply_activation_checkpointing", "checkpointed_blocks"]


def checkpointed_blocks(blocks: Sequence[nn.Module], every_n: int) -> list[nn.Module]:
    """Every `every_n`-th block (1 = all of them), counting from the first."""
    if every_n < 1:
        raise ValueError(f"train.activation_checkpointing every_n must be >= 1, got {every_n}")
    return [b for i, b in enumerate(blocks) if i % every_n == 0]


def apply_activation_checkpointing(blocks: Sequence[nn.Module], every_n: int = 1) -> int:
    """Checkpoints every `every_n`-th of `blocks`; returns how many."""
    chosen = checkpointed_blocks(blocks, every_n)
    for block in chosen:
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            # non-reentrant: works with DDP/FSDP hooks and inputs that need no gradient
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
        # what a model's recompute_flops_per_item counts (hardware FLOPs, perf/hfu)
        block.recomputed = True
    return len(chosen)
