"""Cross-entropy over a vocabulary projection, chunk by chunk, fused with its gradient.

The plain path materialises the logits of a whole micro-batch (positions × vocab) in the compute
dtype, then again in fp32 for a stable softmax, and autograd keeps them for backward: for GPT-2
small at micro 16 × 1024 tokens that is 16,384 × 50,304 × (2 + 4) bytes ≈ 4.9 GB. Here the head
and the softmax run on `chunk` positions at a time, and each chunk's gradients with respect to
the hidden states and the head's weight are computed right away, while its logits exist; backward
only scales them by the incoming gradient. The matmuls are the plain path's (one forward, two for
the gradients), nothing is recomputed, and at most one chunk of logits is ever held.

It returns the *sum* of the item losses, which is what the accumulation step back-propagates: a
sum has one incoming gradient for every item, so the gradients can be formed in forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["chunked_cross_entropy_sum"]


class _ChunkedCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, chunk, dtype, grad_on):
        # forward runs with grad mode off: whether gradients are wanted is passed in
        need_h, need_w = grad_on and hidden.requires_grad, grad_on and weight.requires_grad
        need_b = grad_on and bias is not None and bias.requires_grad
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        for start in range(0, hidden.shape[0], chunk):
            sl = slice(start, start + chunk)
            h = hidden[sl].to(dtype)
            t = target[sl]
            valid = t != ignore_index
            safe_t = torch.where(valid, t, torch.zeros_like(t))
            logits = F.linear(h, w, b).float()
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe_t.unsqueeze(1)).squeeze(1)
            total += torch.where(valid, lse - picked, torch.zeros_like(lse)).sum()
            if not (need_h or need_w or need_b):
                continue
            # d(sum of item losses)/d logits = softmax − onehot(target) on real positions
            grad_logits = torch.exp(logits.sub_(lse.unsqueeze(1)))
            grad_logits.scatter_add_(1, safe_t.unsqueeze(1), -torch.ones_like(lse).unsqueeze(1))
            grad_logits.mul_(valid.unsqueeze(1))
            gl = grad_logits.to(dtype)
            if need_h:
                grad_h[sl] = (gl @ w).to(hidden.dtype)
            if need_w:
                grad_w += (gl.t() @ h).float()
            if need_b:
                grad_b += grad_logits.sum(0)
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        ctx.dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        g = grad_total.float()
        return (
            grad_h * g.to(grad_h.dtype) if grad_h is not None else None,
            (grad_w * g).to(w_dtype) if grad_w is not None else None,
            (grad_b * g).to(b_dtype) if grad_b is not None else None,
            None,
            None,
            None,
            None,
            None,
        )


def chunked_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    chunk: int = 8192,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Sum over positions of the cross-entropy of ``hidden @ weight.T (+ bias)`` against
    `target` (ignored positions add 0), as a 0-dim fp32 tensor: equal to
    ``F.cross_entropy(F.linear(hidden, weight, bias).float(), target, reduction="sum")``
    without holding more than `chunk` positions of logits. The head runs in the autocast dtype
    when autocast is on, as an nn.Linear would.

    hidden: (..., d), flattened to positions; target: the matching (...) class indices.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    dtype = flat.dtype
    if torch.is_autocast_enabled(flat.device.type):
        dtype = torch.get_autocast_dtype(flat.device.type)
    return _ChunkedCrossEntropySum.apply(
        flat, weight, bias, target.reshape(-1), ignore_index, chunk, dtype, torch.is_grad_enabled()
    )
