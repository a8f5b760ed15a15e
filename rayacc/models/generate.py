"""Sampling text from a causal token model: any module whose forward maps ids (B, T) to logits
(B, T, V). No KV cache: each new token runs the model over the last `block_size` tokens, which
costs seconds for the few hundred tokens of a sample of the small models this is for, and keeps
one forward for training and sampling."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["generate"]


@torch.no_grad()
def generate(
    model: nn.Module,
    ids: torch.Tensor,
    new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """`ids` (B, T) followed by `new_tokens` sampled ids: (B, T + new_tokens). Temperature 0
    takes the most likely token; `top_k` samples among the k most likely; `generator` (on the
    ids' device) makes it reproducible. The context is cropped to `block_size` (default: the
    model's `block_size`, when it has one)."""
    if temperature < 0:
        raise ValueError(f"temperature must be ≥ 0 (got {temperature})")
    block = block_size or getattr(model, "block_size", None)
    was_training = model.training
    model.eval()
    for _ in range(new_tokens):
        context = ids if block is None else ids[:, -block:]
        logits = model(context)[:, -1, :].float()
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.size(-1):
                kth = torch.topk(logits, top_k).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator)
        ids = torch.cat([ids, nxt.to(ids.dtype)], dim=1)
    model.train(was_training)
    return ids
