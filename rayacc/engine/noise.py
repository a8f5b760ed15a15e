"""The gradient noise scale (McCandlish et al. 2018, arXiv 1812.06162: B_simple = tr Σ / |G|²)
from what the reduction already sees. Each rank's gradient goes into the all-reduce (DDP) or
the reduce-scatter (FSDP2) as the sum over its items since the last reduction — its share of
the window, or one micro-batch where every micro-step syncs — and E|g_u|² = |G|² + tr Σ / B_u
for such a unit's mean g_u over B_u items, as for the window's mean over N: two batch sizes,
whence the unbiased estimates of tr Σ and |G|² (the paper's appendix A), the units' sums riding
in the next window's reduction — or reduced on their own where no next window of the group is
sure to come (before a checkpoint) or nothing is known yet (a run's first window)."""

from __future__ import annotations

import torch

__all__ = ["NOISE_SMOOTHING", "LocalGradients", "NoiseProbe", "NoiseScale", "noise_estimates"]

NOISE_SMOOTHING = 0.9
"""The weight of the past in the moving averages of tr Σ and |G|² (one window's estimate is
noisy: a single rank's gradient is a small sample)."""


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

    def close_unit(self, items: int, factor: float = 1.0) -> None:
        """The gradient since the last unit was the sum over `items` loss items, as the
        backward left it: times `factor` (what multiplied the loss sums — fp16's loss scale,
        a 1 / N known before the backward): |g_u|² of its mean, kept on the device."""
        if self._pending is not None and items > 0:
            part = self._pending / (float(items) * factor) ** 2
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


class NoiseProbe:
    """An accumulation step's side of the estimate: this rank's units of a window as the
    reduction takes them, their sums handed to the next window's reduction (`riding`), and
    what the window itself measured (|g|², items) for when they arrive."""

    def __init__(self, local: LocalGradients):
        self.local = local
        self.sums = [0.0, 0.0, 0.0]
        """This rank's [Σ|g_u|², Σ 1/B_u, units] of the last window, not yet reduced."""
        self.previous: tuple[float, int] | None = None
        """The last window's |g|² and loss items, while its sums are not yet reduced."""
        self.unit_items: list[int] | None = None
        """Loss items per micro-batch of the window running (None: counted as it goes)."""
        self.factor = 1.0
        """What the window's backward multiplied its loss sums by (fp16's loss scale × a scale
        known before the backward): the reduction sees the gradients so scaled."""
        self._open = 0  # loss items since the reduction last took a gradient

    def riding(self) -> list[float]:
        """The sums that ride in this window's reduction; the window's own units start."""
        self.local.reset()
        self._open = 0
        return self.sums

    def arrived(self, sums: list[float]) -> tuple[float, float] | None:
        """The last window's (tr Σ, |G|²) from its sums over every rank, or None."""
        return noise_estimates(sums, *self.previous) if self.previous is not None else None

    def after_backward(self, i: int, counted: int) -> None:
        """Micro-step `i` went back (`counted`: its items where counted on the way); a unit
        closes where the reduction took its gradient."""
        self._open += counted + (self.unit_items[i] if self.unit_items else 0)
        if self.local.reduced:
            self.local.close_unit(self._open, self.factor)
            self._open = 0

    def stepped(self, big_square: float | None, items: int) -> None:
        """The window ended: its units' sums and, where it stepped (`big_square` = |g|² of its
        mean gradient), what pairs with them; a window that did not step measures nothing."""
        self.sums = self.local.take() if big_square is not None else [0.0, 0.0, 0.0]
        self.previous = (big_square, items) if big_square is not None else None

    @property
    def pending(self) -> bool:
        """Whether the last window's sums wait for a reduction (the same on every rank)."""
        return self.previous is not None

    def settled(self, reduced: list[float]) -> tuple[float, float] | None:
        """The last window's estimate from its sums reduced on their own; none rides on."""
        estimate = self.arrived(reduced)
        self.sums, self.previous = [0.0, 0.0, 0.0], None
        return estimate


class NoiseScale:
    """B_simple as logged: tr Σ and |G|² each smoothed over the windows (`NOISE_SMOOTHING`, the
    paper's way), their ratio. Kept by a checkpoint, so a resumed run logs what the
    uninterrupted one does."""

    def __init__(self) -> None:
        self.smoothed: tuple[float, float] | None = None

    def absorb(self, estimate: tuple[float, float] | None) -> None:
        if estimate is None:
            return
        a, old = NOISE_SMOOTHING, self.smoothed or estimate
        trace, square = (a * o + (1 - a) * n for o, n in zip(old, estimate, strict=True))
        self.smoothed = (trace, square)

    def move(self, global_batch: int) -> int:
        """The batch schedule's rule (`batch.schedule: auto`): +1 doubles the global batch,
        −1 halves it, 0 holds. The ratio decides where both estimates are positive (double at
        B_simple ≥ 2·batch, halve below batch / 2). A negative estimate is a sign, not a
        size: |G|² ≤ 0 with tr Σ > 0 is a gradient buried in its noise (double); tr Σ ≤ 0
        with |G|² > 0 is noise negligible beside the gradient (B_simple ≈ 0: halve); both ≤ 0
        is no estimate (hold)."""
        if self.smoothed is None:
            return 0
        trace, square = self.smoothed
        if trace <= 0 and square <= 0:
            return 0
        if square <= 0:
            return 1
        if trace <= 0:
            return -1
        value = trace / square
        return 1 if value >= 2 * global_batch else -1 if value < global_batch / 2 else 0

    @property
    def value(self) -> float | None:
        """tr Σ / |G|² smoothed; None before any estimate. Negative where one estimate is
        (`move` says what each sign means)."""
        if self.smoothed is None or self.smoothed[1] == 0:
            return None
        return self.smoothed[0] / self.smoothed[1]

    def state_dict(self) -> dict[str, list[float]]:
        return {"smoothed": list(self.smoothed)} if self.smoothed is not None else {}

    def load_state_dict(self, state: dict) -> None:
        pair = state.get("smoothed")
        self.smoothed = (float(pair[0]), float(pair[1])) if pair else None
