"""The gradient noise scale (McCandlish et al. 2018, arXiv 1812.06162: B_simple = tr Σ / |G|²)
from what the reduction already sees. Each rank's gradient goes into the all-reduce (DDP) or
the reduce-scatter (FSDP2) as the sum over its items since the last reduction — its share of
the window, or one micro-batch where every micro-step syncs — and E|g_u|² = |G|² + tr Σ / B_u
for such a unit's mean g_u over B_u items, as for the window's mean over N: two batch sizes,
whence the unbiased estimates of tr Σ and |G|² (the paper's appendix A), the units' sums riding
in the next window's reduction."""

from __future__ import annotations

import torch

__all__ = ["LocalGradients", "noise_estimates"]


class LocalGradients:
    """A rank's gradients as its hooks hand them to the reduction, measured by unit."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._pending: torch.Tensor | None = None
        self._sum: torch.Tensor | None = None
        self._inverse_items = 0.0
        self._units = 0

    def observe(self, grads: torch.Tensor) -> None:
        """A flat piece of this rank's gradient sum, on its way into a reduction."""
        square = grads.detach().float().pow(2).sum()
        self._pending = square if self._pending is None else self._pending + square

    @property
    def reduced(self) -> bool:
        """Whether a reduction took a gradient since the last unit was closed."""
        return self._pending is not None

    def close_unit(self, items: int) -> None:
        """The gradient since the last unit was the sum over `items` loss items: |g_u|² of its
        mean, kept on the device."""
        if self._pending is not None and items > 0:
            part = self._pending / float(items) ** 2
            self._sum = part if self._sum is None else self._sum + part
            self._inverse_items += 1.0 / items
            self._units += 1
        self._pending = None

    def take(self) -> list[float]:
        """[Σ|g_u|², Σ 1/B_u, units] of this rank's window (summed over ranks they are the
        window's), and a fresh start."""
        out = [float(self._sum) if self._sum is not None else 0.0, self._inverse_items]
        out.append(float(self._units))
        self.reset()
        return out


def noise_estimates(sums: list[float], big_square: float, items: int) -> tuple[float, float] | None:
    """(tr Σ, |G|²) estimated from the units' sums over every rank ([Σ|g_u|², Σ 1/B_u, U])
    and the window's mean gradient (|g|² over its `items`); None where the two batch sizes
    coincide (one unit held every item)."""
    small_square, inverse_items, units = sums
    if units <= 0 or items <= 0:
        return None
    small, inverse_small = small_square / units, inverse_items / units
    span = inverse_small - 1.0 / items
    if span <= 1e-12 * inverse_small:
        return None
    trace = (small - big_square) / span
    return trace, big_square - trace / items
