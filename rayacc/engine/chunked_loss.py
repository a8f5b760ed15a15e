"""Cross-entropy over a vocabulary projection, chunk by chunk.

The plain path materialises the logits of a whole micro-batch (positions × vocab), once in the
compute dtype and once more in fp32 for a stable softmax: for GPT-2 small at micro 16 × 1024
tokens that is 16,384 × 50,304 × (2 + 4) bytes ≈ 4.9 GB, and autograd keeps them for backward.
Here the projection and the softmax run on `chunk` positions at a time; forward keeps only the
per-position log-sum-exp, and backward recomputes each chunk's logits (one more matmul of the
head, the price of never holding more than one chunk of logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["chunked_cross_entropy"]


def _compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    # the head matmul runs in the autocast dtype, as nn.Linear would under autocast
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return dtype


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, chunk, dtype):
        n = hidden.shape[0]
        losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        for start in range(0, n, chunk):
            sl = slice(start, start + chunk)
            logits = F.linear(hidden[sl].to(dtype), w, b).float()
            lse[sl] = torch.logsumexp(logits, dim=-1)
            t = target[sl]
            valid = t != ignore_index
            picked = logits.gather(1, t.clamp_min(0).unsqueeze(1)).squeeze(1)
            losses[sl] = torch.where(valid, lse[sl] - picked, torch.zeros_like(picked))
        ctx.save_for_backward(hidden, weight, bias, target, lse)
        ctx.ignore_index, ctx.chunk, ctx.dtype = ignore_index, chunk, dtype
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, bias, target, lse = ctx.saved_tensors
        dtype, chunk = ctx.dtype, ctx.chunk
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        )
        grad_bias = (
            torch.zeros_like(bias, dtype=torch.float32)
            if bias is not None and ctx.needs_input_grad[2]
            else None
        )
        for start in range(0, hidden.shape[0], chunk):
            sl = slice(start, start + chunk)
            h = hidden[sl].to(dtype)
            probs = torch.exp(F.linear(h, w, b).float() - lse[sl].unsqueeze(1))
            t = target[sl]
            valid = t != ctx.ignore_index
            g = torch.where(valid, grad_losses[sl].float(), torch.zeros_like(lse[sl]))
            # d loss_i / d logits_i = softmax_i − onehot(target_i), times the upstream grad
            probs[torch.arange(len(t), device=t.device)[valid], t[valid]] -= 1.0
            grad_logits = (probs * g.unsqueeze(1)).to(dtype)
            if grad_hidden is not None:
                grad_hidden[sl] = (grad_logits @ w).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += (grad_logits.t() @ h).float()
            if grad_bias is not None:
                grad_bias += grad_logits.float().sum(0)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk: int = 8192,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Per-position cross-entropy of `hidden @ weight.T (+ bias)` against `target`, equal to
    ``F.cross_entropy(F.linear(hidden, weight, bias).float(), target, reduction="none")``
    (ignored positions give 0) without holding more than `chunk` positions of logits.

    hidden: (..., d) — flattened to positions; target: the matching (...) class indices.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    dtype = _compute_dtype(hidden.device, flat.dtype)
    return _ChunkedCrossEntropy.apply(
        flat, weight, bias, target.reshape(-1), ignore_index, chunk, dtype
    )
