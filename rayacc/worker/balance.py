"""`batch.balance: auto`: each rank's share of a window follows its measured time per row, so a
slow rank takes fewer rows and the others more, the global batch and the update unchanged (the
one rule divides by the window's global count, whatever each rank held).

Every rank decides alone and alike: its inputs are every rank's own time (`observe/ranks.py`:
computing, waiting for data, stepping; not waiting for peers), which the window's reduction
brings to every rank one window late, and the rows each rank held, which every rank knows
from the layout. Moves are bounded (`MOVE` of a share at a time, every `EVERY` windows, only
for a predicted `GAIN`), and no share goes below the window's micro-steps (the micro-batch
stays, so no rank needs more memory than before)."""

from __future__ import annotations

from collections.abc import Sequence

from rayacc.observe.ranks import FIELDS

__all__ = ["EVERY", "GAIN", "MOVE", "ShareBalancer"]

EVERY = 4
"""Windows measured between two decisions."""
MOVE = 0.25
"""The most a share moves at once, as a fraction of it."""
GAIN = 0.1
"""The least fall of the slowest rank's predicted time (a fraction) worth a change."""
_OWN, _WIDTH = FIELDS.index("own_s"), len(FIELDS)


class ShareBalancer:
    """Measures each rank's own time per row over `EVERY` windows and proposes shares."""

    def __init__(self, width: int = _WIDTH):
        self.width = width
        """Figures in one rank's report (`FIELDS`, then any node figures)."""
        self.reset()

    def reset(self) -> None:
        """Forget what was measured (the split changed under it)."""
        self._pending: tuple[int, ...] | None = None
        self._rows: list[int] = []
        self._own: list[float] = []
        self._windows = 0

    def window(
        self, rows: Sequence[int], figures: Sequence[float], owners: Sequence[int] = ()
    ) -> None:
        """`rows`: each data-parallel rank's rows of the window just run; `figures`: every
        rank's figures of the window before it, flat in rank order (as the reduction brings
        them); `owners`: each rank's data-parallel rank where they differ (tensor
        parallelism: a share takes its slowest rank's time)."""
        before, self._pending = self._pending, tuple(rows)
        own = list(figures[_OWN :: self.width])
        if owners and len(owners) == len(own):
            slowest: dict[int, float] = {}
            for owner, t in zip(owners, own, strict=True):
                slowest[owner] = max(t, slowest.get(owner, t))
            own = [slowest[d] for d in sorted(slowest)]
        if before is None or len(own) != len(before):
            return
        if not self._rows:
            self._rows, self._own = [0] * len(before), [0.0] * len(before)
        self._rows = [a + b for a, b in zip(self._rows, before, strict=True)]
        self._own = [a + b for a, b in zip(self._own, own, strict=True)]
        self._windows += 1

    def decide(self, shares: Sequence[int], micro: int) -> tuple[tuple[int, ...], str] | None:
        """New shares of a full window (and why), or None: too little measured yet, nothing
        worth moving, or a move that would leave a rank fewer rows than micro-steps."""
        if self._windows < EVERY:
            return None
        rows, own = self._rows, self._own
        self._rows, self._own, self._windows = [], [], 0
        if len(rows) != len(shares) or min(rows) <= 0 or min(own) <= 0:
            return None
        per_row = [o / r for o, r in zip(own, rows, strict=True)]
        speed = [1.0 / t for t in per_row]
        total = sum(shares)
        target = [total * v / sum(speed) for v in speed]
        # the same fraction of the way for every rank: the sum stays, no share moves by more
        # than MOVE of itself
        gaps = [abs(t - s) for t, s in zip(target, shares, strict=True)]
        way = min([1.0] + [MOVE * s / g for s, g in zip(shares, gaps, strict=True) if g])
        new = _whole([s + way * (t - s) for t, s in zip(target, shares, strict=True)], total)
        if min(new) < -(-max(new) // micro):
            return None
        now = max(t * s for t, s in zip(per_row, shares, strict=True))
        then = max(t * n for t, n in zip(per_row, new, strict=True))
        if tuple(new) == tuple(shares) or then > (1 - GAIN) * now:
            return None
        slow = max(range(len(per_row)), key=per_row.__getitem__)
        fast = min(per_row)
        why = f"rank {slow}: {per_row[slow] / fast:.2f}× the fastest rank's time per row"
        return tuple(new), why


def _whole(values: Sequence[float], total: int) -> list[int]:
    """`values` scaled to `total` and made whole: the floors, then one more row for the
    largest remainders (the lower rank first on a tie), so the same on every rank."""
    scaled = [v * total / sum(values) for v in values]
    out = [int(v) for v in scaled]
    order = sorted(range(len(scaled)), key=lambda i: (out[i] - scaled[i], i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out
