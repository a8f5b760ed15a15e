"""User objectives (`train.loss`) the tests name by import path, as a user's package would."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100
SMOOTHING = 0.1


def label_smoothed(output: torch.Tensor, batch) -> tuple[torch.Tensor, int]:
    """Label-smoothed cross-entropy over the counted targets: (sum, count)."""
    target = batch["target"].reshape(-1)
    keep = target != IGNORE
    logits = output.reshape(-1, output.shape[-1])[keep].float()
    loss = F.cross_entropy(logits, target[keep], reduction="sum", label_smoothing=SMOOTHING)
    return loss, int(keep.sum())


def pair_margin(output: torch.Tensor, batch) -> tuple[torch.Tensor, int]:
    """A pair loss (DPO's shape without a reference model): rows come in (chosen, rejected)
    pairs; each pair's item is -log σ(log p(chosen) − log p(rejected)) over counted targets."""
    logp = torch.log_softmax(output.float(), -1)
    target = batch["target"]
    keep = target != IGNORE
    picked = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * keep
    per_row = picked.sum(-1)
    chosen, rejected = per_row[0::2], per_row[1::2]
    return -F.logsigmoid(chosen - rejected).sum(), int(chosen.numel())


def not_a_pair(output, batch):
    return output.sum()


def negative_count(output, batch):
    return output.sum(), -1
