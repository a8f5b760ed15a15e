"""The chunked cross-entropy equals the plain one, loss and gradients, with padding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rayacc.engine.chunked_loss import chunked_cross_entropy_sum


def _case(seed: int, positions: int = 37, d: int = 16, vocab: int = 50, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(positions, d, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, d, generator=g, dtype=torch.float64) * 0.3
    b = torch.randn(vocab, generator=g, dtype=torch.float64) if bias else None
    target = torch.randint(0, vocab, (positions,), generator=g)
    target[::5] = -100  # padding positions
    return hidden, weight, b, target


def plain_sum(h, w, b, t):
    return F.cross_entropy(F.linear(h, w, b).float(), t, reduction="sum", ignore_index=-100)


def _loss_and_grads(loss_fn, hidden, weight, bias, target, dtype, upstream=1.7):
    leaves = [t.to(dtype).requires_grad_() for t in (hidden, weight)]
    b = bias.to(dtype).requires_grad_() if bias is not None else None
    loss = loss_fn(leaves[0], leaves[1], b, target)
    (loss * upstream).backward()  # an incoming gradient other than 1 reaches every item
    grads = [leaves[0].grad, leaves[1].grad] + ([b.grad] if b is not None else [])
    return loss.detach(), grads


@pytest.mark.parametrize("chunk", [1, 8, 37, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_equals_plain_loss_and_gradient(chunk, bias):
    case = _case(chunk, bias=bias)

    def chunked(h, w, b, t):
        return chunked_cross_entropy_sum(h, w, t, bias=b, chunk=chunk)

    ref_loss, ref_grads = _loss_and_grads(plain_sum, *case, torch.float64)
    loss, grads = _loss_and_grads(chunked, *case, torch.float64)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss.double(), ref_loss.double(), rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # padding positions get no gradient
    assert bool((grads[0][::5] == 0).all())


def test_chunked_follows_autocast_like_a_linear_head():
    hidden, weight, _, target = _case(3, positions=64, d=32, vocab=80)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref_grads = _loss_and_grads(
            plain_sum, hidden, weight, None, target, torch.float32
        )
        loss, grads = _loss_and_grads(
            lambda h, w, b, t: chunked_cross_entropy_sum(h, w, t, chunk=16),
            hidden,
            weight,
            None,
            target,
            torch.float32,
        )
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-3)
    for got, want in zip(grads, ref_grads, strict=True):
        rel = float((got - want).norm() / want.norm())
        assert rel < 2e-2, rel
    # the head really ran in bf16: fp32 gives a visibly different loss
    fp32_loss, _ = _loss_and_grads(plain_sum, hidden, weight, None, target, torch.float32)
    assert float((fp32_loss - loss).abs()) > 1e-5


def test_no_gradients_are_formed_without_grad_mode():
    hidden, weight, _, target = _case(5)
    w = weight.clone().requires_grad_()
    with torch.no_grad():
        loss = chunked_cross_entropy_sum(hidden, w, target, chunk=8)
    torch.testing.assert_close(loss.double(), plain_sum(hidden, weight, None, target).double())
    assert not loss.requires_grad


def test_shapes_and_bad_chunk():
    h = torch.randn(2, 5, 4)
    w = torch.randn(7, 4)
    t = torch.randint(0, 7, (2, 5))
    assert chunked_cross_entropy_sum(h, w, t, chunk=3).shape == ()
    with pytest.raises(ValueError, match="chunk"):
        chunked_cross_entropy_sum(h, w, t, chunk=0)
