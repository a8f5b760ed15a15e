"""A user's token model whose forward takes the ids alone (no `documents`)."""

from __future__ import annotations

import torch
from torch import nn


class Plain(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, 8)
        self.out = nn.Linear(8, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(idx))


def build(dataset) -> nn.Module:
    return Plain(dataset.vocab_size)
