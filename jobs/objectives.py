"""Objectives for `train.loss` (rayacc divides and accumulates; each returns the sum of its loss
items and their count). Importable where the job runs: `PYTHONPATH=$PWD rayacc train -c
jobs/finetune_chat.yaml train.loss=jobs.objectives:label_smoothed`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rayacc.models.objective import weighted_items

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


@weighted_items
def sqrt_row_weighted(output: torch.Tensor, batch) -> tuple[torch.Tensor, float]:
    """Cross-entropy over the counted targets, each of a row's n weighted 1/√n (between one
    item a token and one item a row: long answers count more, not n times more). Its count is
    the sum of the weights, a real: declared with `weighted_items`, the one rule divides the
    window's sum by the global sum of weights."""
    target = batch["target"]
    keep = (target != IGNORE).float()
    tokens = F.cross_entropy(output.float().transpose(1, 2), target.clamp(min=0), reduction="none")
    n = keep.sum(-1)
    weight = keep / n.clamp(min=1.0).sqrt().unsqueeze(-1)
    return (tokens * weight).sum(), float(weight.sum())
