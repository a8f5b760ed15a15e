"""The chunked cross-entropy equals the plain one, loss and gradients, with padding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rayacc.engine.chunked_loss import chunked_cross_entropy


def _case(seed: int, positions: int = 37, d: int = 16, vocab: int = 50, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(positions, d, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, d, generator=g, dtype=torch.float64) * 0.3
    b = torch.randn(vocab, generator=g, dtype=torch.float64) if bias else None
    target = torch.randint(0, vocab, (positions,), generator=g)
    target[::5] = -100  # padding positions
    upstream = torch.rand(positions, generator=g, dtype=torch.float64)
    return hidden, weight, b, target, upstream


def _grads(loss_fn, hidden, weight, bias, target, upstream, dtype):
    leaves = [t.to(dtype).requires_grad_() for t in (hidden, weight)]
    b = bias.to(dtype).requires_grad_() if bias is not None else None
    losses = loss_fn(leaves[0], leaves[1], b, target)
    (losses * upstream.to(losses.dtype)).sum().backward()
    grads = [leaves[0].grad, leaves[1].grad] + ([b.grad] if b is not None else [])
    return losses.detach(), grads


def plain(h, w, b, t):
    return F.cross_entropy(F.linear(h, w, b).float(), t, reduction="none", ignore_index=-100)


@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_equals_plain_loss_and_gradient(chunk, bias):
    case = _case(chunk, bias=bias)

    def chunked(h, w, b, t):
        return chunked_cross_entropy(h, w, t, bias=b, chunk=chunk)

    ref_loss, ref_grads = _grads(plain, *case, torch.float64)
    loss, grads = _grads(chunked, *case, torch.float64)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), ref_loss.double(), rtol=1e-6, atol=1e-6)
    assert bool((loss[::5] == 0).all()), "padding positions carry no loss"
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_chunked_follows_autocast_like_a_linear_head():
    hidden, weight, _, target, upstream = _case(3, positions=64, d=32, vocab=80)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref_grads = _grads(plain, hidden, weight, None, target, upstream, torch.float32)
        loss, grads = _grads(
            lambda h, w, b, t: chunked_cross_entropy(h, w, t, chunk=16),
            hidden,
            weight,
            None,
            target,
            upstream,
            torch.float32,
        )
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    for got, want in zip(grads, ref_grads, strict=True):
        rel = float((got - want).norm() / want.norm())
        assert rel < 2e-2, rel
    # and it is not trivially close: fp32 differs from bf16 by more than the fp64 rounding
    fp32_loss, _ = _grads(plain, hidden, weight, None, target, upstream, torch.float32)
    assert float((fp32_loss - loss).abs().max()) > 1e-6


def test_shapes_and_bad_chunk():
    h = torch.randn(2, 5, 4)
    w = torch.randn(7, 4)
    t = torch.randint(0, 7, (2, 5))
    assert chunked_cross_entropy(h, w, t, chunk=3).shape == (10,)
    with pytest.raises(ValueError, match="chunk"):
        chunked_cross_entropy(h, w, t, chunk=0)
