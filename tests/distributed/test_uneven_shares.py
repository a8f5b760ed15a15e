"""A window split by rows, not by ranks: at a worker count that does not divide the global batch
(fixed, or an elastic size), each rank takes its share (`BatchSplit.shares`), runs as many
micro-steps as the largest share needs (so every collective pairs up), and the update equals
the single-process full-batch steps: DDP and FSDP2 in both sync modes on 3 gloo ranks here;
ZeRO on the DeepSpeed tests' 2 ranks (tests/distributed/test_deepspeed.py)."""

from __future__ import annotations

import pytest
import torch

from tests.support.ranks import uneven as U
from tests.support.ranks.engine_helpers import spawn_ranks, update_rel_err

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = spawn_ranks(U.run_rank, 3, tmp_path_factory.mktemp("uneven"), "uneven shares")
    for r in out:
        assert "error" not in r, r.get("error")
    return out


@pytest.mark.parametrize("strategy", U.STRATEGIES)
def test_uneven_shares_equal_the_full_batch_steps(ranks, strategy, record_equivalence):
    got = [r[strategy] for r in ranks]
    assert [g["shares"] for g in got] == [(4, 4, 3)] * 3
    # 11 rows a window: micro-batches of at most 2, two micro-steps on every rank (the third
    # rank's second holds one row); then the short last window of 6 rows, 2 a rank
    assert [[s[2] for s in g["steps"]] for g in got] == [
        [[2, 2], [2, 2], [2]],
        [[2, 2], [2, 2], [2]],
        [[2, 1], [2, 1], [2]],
    ]
    assert [(items, micro_steps) for items, micro_steps, _ in got[0]["steps"]] == [
        (11, 2),
        (11, 2),
        (6, 1),
    ]
    before, after = U.reference(3)
    assert torch.equal(got[0]["before"], before)
    err = update_rel_err(before, got[0]["after"], after)
    record_equivalence(f"uneven shares 4+4+3 on 3 ranks, {strategy}", err)
    assert err <= 1e-5, err
