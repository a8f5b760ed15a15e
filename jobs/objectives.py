"""Objectives for `train.loss` (rayacc divides and accumulates; each returns the sum of its loss
items and their count). Importable where the job runs: `PYTHONPATH=$PWD rayacc train -c
jobs/finetune_chat.yaml train.loss=jobs.objectives:label_smoothed`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100
"""A target rayacc does not count (padding, a prompt token the loss mask leaves out)."""
SMOOTHING = 0.1


def label_smoothed(output: torch.Tensor, batch) -> tuple[torch.Tensor, int]:
    """Label-smoothed cross-entropy (Szegedy et al.) over the counted targets: one item each."""
    target = batch["target"].reshape(-1)
    keep = target != IGNORE
    logits = output.reshape(-1, output.shape[-1])[keep].float()
    loss = F.cross_entropy(logits, target[keep], reduction="sum", label_smoothing=SMOOTHING)
    return loss, int(keep.sum())


def pair_margin(output: torch.Tensor, batch) -> tuple[torch.Tensor, int]:
    """A DPO-shaped pair loss without a reference model: rows come in (chosen, rejected) pairs
    (keep data.shuffle false and micro-batches even); one item per pair,
    -log σ(log p(chosen) − log p(rejected)) over each row's counted targets. Its items are
    pairs, not tokens: it runs where the count may come with the forward (DDP, FSDP)."""
    logp = torch.log_softmax(output.float(), -1)
    target = batch["target"]
    keep = target != IGNORE
    picked = logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * keep
    per_row = picked.sum(-1)
    chosen, rejected = per_row[0::2], per_row[1::2]
    return -F.logsigmoid(chosen - rejected).sum(), int(chosen.numel())
