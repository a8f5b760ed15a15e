"""Per-item loss functions and item counters for the two data formats.

A loss function returns one loss per loss item (ignored items contribute exactly 0), or their
sum as a 0-dim tensor (a fused kernel such as `chunked_cross_entropy_sum` never forms the
per-item values), or the pair (sum, count) of an objective that counts its own items; an item
counter says how many real items a micro-batch holds (0 for such an objective: its items come
with its losses). The accumulation step normalises.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "ItemCounter",
    "LossFn",
    "classification_item_losses",
    "collate_tokens",
    "count_rows",
    "count_target_tokens",
    "counted_with_losses",
    "model_inputs",
    "split_rows",
    "summed",
    "to_device",
    "token_item_losses",
]

Batch = Mapping[str, torch.Tensor]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
ItemCounter = Callable[[Batch], int]


def to_device(
    batch: Batch, device: torch.device, non_blocking: bool = False
) -> dict[str, torch.Tensor]:
    """The batch's tensors on `device` (`non_blocking` copies from pinned host memory overlap
    with compute on a GPU)."""
    return {k: v.to(device, non_blocking=non_blocking) for k, v in batch.items()}


IGNORE_INDEX = -100
"""Target value of padding positions; matches F.cross_entropy's default ignore_index."""


def model_inputs(batch: Batch) -> dict[str, torch.Tensor]:
    """What a token model takes beside the input ids: packed rows' `documents` (each
    example's attention kept to itself)."""
    return {"documents": batch["documents"]} if "documents" in batch else {}


def summed(out: torch.Tensor | tuple[torch.Tensor, int]) -> tuple[torch.Tensor, int]:
    """A loss function's result as (its sum in float32 or wider, the items it counted itself:
    0 where its counter counts them)."""
    if isinstance(out, tuple):
        return out[0].float(), out[1]
    return out.float().sum(), 0


def counted_with_losses(batch: Batch) -> int:
    """The item counter of an objective that returns its own count with its losses."""
    return 0


def count_rows(batch: Batch) -> int:
    """Samples in a micro-batch: the leading dimension of its first tensor."""
    return int(next(iter(batch.values())).shape[0])


def split_rows(batch: Batch, parts: int) -> list[Batch]:
    """`batch` cut along its rows into `parts` micro-batches (sizes differ by at most one)."""
    pieces = {k: torch.tensor_split(v, parts) for k, v in batch.items()}
    return [{k: v[i] for k, v in pieces.items()} for i in range(parts)]


def classification_item_losses(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Cross-entropy per sample of `features` → `label`."""
    logits = model(batch["features"])
    return F.cross_entropy(logits.float(), batch["label"], reduction="none")


def count_target_tokens(batch: Batch) -> int:
    """Target tokens that carry a loss (padding excluded). A host sync when on a GPU."""
    return int((batch["target"] != IGNORE_INDEX).sum())


def token_item_losses(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Next-token cross-entropy per target position; padding positions give 0."""
    logits = model(batch["input"], **model_inputs(batch))
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        batch["target"].reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )


def collate_tokens(
    sequences: list[torch.Tensor] | list[list[int]], pad_id: int = 0
) -> dict[str, torch.Tensor]:
    """Variable-length token sequences → right-padded `input` (tokens[:-1]) and `target`
    (tokens[1:], padding = IGNORE_INDEX). Causal attention keeps real positions from seeing the
    padding that follows them."""
    seqs = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
    if any(len(s) < 2 for s in seqs):
        raise ValueError("every token sequence needs at least 2 tokens (an input and a target)")
    width = max(len(s) for s in seqs) - 1
    inputs = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    targets = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)
    for i, s in enumerate(seqs):
        n = len(s) - 1
        inputs[i, :n] = s[:-1]
        targets[i, :n] = s[1:]
    return {"input": inputs, "target": targets}
