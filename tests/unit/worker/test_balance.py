"""`batch.balance: auto` (worker/balance.py): shares follow each rank's own time per row, one
window late as the reduction brings the figures, bounded in how fast they move, never below a
window's micro-steps, and the same on every rank (a pure function of what every rank holds)."""

from __future__ import annotations

import pytest

from rayacc.observe.ranks import FIELDS
from rayacc.worker.balance import EVERY, GAIN, MOVE, ShareBalancer

OWN = FIELDS.index("own_s")


def figures(own: list[float]) -> list[float]:
    """Every rank's report, flat, with its own time in place (the rest zero)."""
    out = []
    for o in own:
        report = [0.0] * len(FIELDS)
        report[OWN] = o
        out += report
    return out


def measure(balancer: ShareBalancer, shares, per_row, windows: int = EVERY + 1):
    """`windows` windows at `shares`, rank r taking per_row[r] s a row; each window's figures
    arrive with the next one, as the reduction brings them."""
    for _ in range(windows):
        before = getattr(balancer, "_pending", None)
        ran = [] if before is None else [t * n for t, n in zip(per_row, before, strict=True)]
        balancer.window(shares, figures(ran))


def test_a_slow_rank_takes_fewer_rows_and_the_move_is_bounded():
    balancer = ShareBalancer()
    shares = (32, 32, 32)
    measure(balancer, shares, [0.01, 0.01, 0.03])
    new, why = balancer.decide(shares, micro=4)
    assert sum(new) == 96 and new[2] < 32 < min(new[:2])
    assert new[2] >= 32 * (1 - MOVE) - 1  # a quarter at most at once (and a row of rounding)
    assert "rank 2: 3.00×" in why


def test_even_ranks_or_too_little_measured_move_nothing():
    balancer = ShareBalancer()
    measure(balancer, (16, 16), [0.01, 0.01])
    assert balancer.decide((16, 16), micro=4) is None
    balancer.reset()
    measure(balancer, (16, 16), [0.01, 0.05], windows=EVERY)  # the first report is one late
    assert balancer.decide((16, 16), micro=4) is None


def test_decisions_converge_to_equal_times_and_stop():
    shares, per_row, balancer = (40, 40), [0.01, 0.02], ShareBalancer()
    for _ in range(20):
        measure(balancer, shares, per_row)
        decided = balancer.decide(shares, micro=8)
        if decided is None:
            break
        shares = decided[0]
    times = [t * n for t, n in zip(per_row, shares, strict=True)]
    assert sum(shares) == 80 and max(times) <= min(times) / (1 - GAIN) ** 2, (shares, times)
    measure(balancer, shares, per_row)
    assert balancer.decide(shares, micro=8) is None  # no thrash once balanced


def test_no_share_below_the_windows_micro_steps():
    # 9 rows over 3 ranks, micro 1: any move leaves a rank fewer rows than the largest's steps
    balancer = ShareBalancer()
    measure(balancer, (3, 3, 3), [0.01, 0.01, 0.1])
    assert balancer.decide((3, 3, 3), micro=1) is None


@pytest.mark.parametrize("order", ["as given", "reversed"])
def test_every_rank_decides_alike(order):
    runs = []
    for _ in range(2):
        balancer = ShareBalancer()
        measure(balancer, (21, 21, 22), [0.013, 0.011, 0.017])
        runs.append(balancer.decide((21, 21, 22), micro=4))
    assert runs[0] == runs[1] and runs[0] is not None


def test_under_tensor_parallelism_a_share_takes_its_slowest_ranks_time():
    """Four ranks, two per share (dp 0: ranks 0, 1; dp 1: ranks 2, 3, as the mesh places them):
    rank 3 is slow, so share 1 is, whatever its fast peer measured."""
    from rayacc.worker.telemetry import _owners

    places = [(("dp", d), ("tp", t)) for d in (0, 1) for t in (0, 1)]
    owners = _owners(places)
    assert owners == (0, 0, 1, 1)
    balancer = ShareBalancer()
    shares = (32, 32)
    for _ in range(EVERY + 1):
        before = balancer._pending
        ran = [] if before is None else [0.01 * before[o] * (3 if r == 3 else 1)
                                         for r, o in enumerate(owners)]  # fmt: skip
        balancer.window(shares, figures(ran), owners)
    new, _ = balancer.decide(shares, micro=4)
    assert new[1] < 32 < new[0]
