"""`grad/noise_scale` (McCandlish's B_simple): the step's estimate of tr Σ and |G|² from each
rank's gradient as the reduction takes it agrees with the same estimate computed directly in
one process, under DDP and FSDP2 in both sync modes, and under DDP in fp16 from unscaled
gradients (2 gloo ranks)."""

from __future__ import annotations

import pytest

from tests.support.ranks import noise as N
from tests.support.ranks.engine_helpers import spawn_ranks

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = spawn_ranks(N.run_rank, 2, tmp_path_factory.mktemp("noise"), "noise scale")
    for r in out:
        assert "error" not in r, r.get("error")
    return out


@pytest.mark.parametrize("strategy", N.STRATEGIES)
def test_the_noise_scale_is_the_direct_computations(ranks, strategy):
    first, second = ranks[0][strategy]
    assert first is None  # a window's estimate arrives with the next window's reduction
    assert ranks[1][strategy][1] == second  # every rank holds the same
    trace, square = second
    want_trace, want_square = N.direct(strategy)
    rel = N.TOLERANCE.get(strategy, 1e-6)
    assert trace == pytest.approx(want_trace, rel=rel)
    assert square == pytest.approx(want_square, rel=rel)
    assert trace / square == pytest.approx(want_trace / want_square, rel=rel)


@pytest.mark.parametrize("strategy", N.STRATEGIES)
def test_a_window_settled_on_its_own_gives_the_same_estimate_and_none_rides_on(ranks, strategy):
    """Before a checkpoint (or at a run's first window) the sums are reduced on their own:
    the same estimate, and the next window brings none (each window is counted once)."""
    settled, after, again = ranks[0][strategy + " settled"]
    assert ranks[1][strategy + " settled"][0] == settled
    want_trace, want_square = N.direct(strategy)
    rel = N.TOLERANCE.get(strategy, 1e-6)
    assert settled[0] == pytest.approx(want_trace, rel=rel)
    assert settled[1] == pytest.approx(want_square, rel=rel)
    assert after is None and again is not None  # the second window's own, settled in turn
