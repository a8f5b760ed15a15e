"""DeepSpeed ZeRO as a strategy (engine/parallel/deepspeed.py) on 2 gloo ranks: one optimizer
step over micro × accumulation × workers equals the single-process full-batch step at every
stage, with and without optimizer offload, for a full window and a short last one; and the
user's DeepSpeed config is merged under the job's keys or refused naming both values."""

from __future__ import annotations

import pytest
import torch

from tests.support.ranks import deepspeed_workers as W
from tests.support.ranks.engine_helpers import (
    classification_rows,
    full_batch_classification_loss,
    reference_sgd_step,
    slice_rows,
    spawn_ranks,
    update_rel_err,
)

pytestmark = pytest.mark.distributed
deepspeed = pytest.importorskip("deepspeed")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("deepspeed")
    out = spawn_ranks(W.run_rank, 2, out_dir, "DeepSpeed cases")
    for r in out:
        assert "error" not in r, r.get("error")
        r["out_dir"] = out_dir
    return out


def reference(stage: int, offload: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The same model's weights before and after the same two steps in one process, each on
    its window's whole rows."""
    from rayacc.models import build_model

    model = build_model(W.config(stage, offload), W.dataset())
    before = torch.cat([p.detach().reshape(-1).double().clone() for p in model.parameters()])
    rows = classification_rows(28, seed=9)
    for lo, hi, _ in W.WINDOWS:
        loss = full_batch_classification_loss(model, slice_rows(rows, lo, hi))
        reference_sgd_step(model, loss, W.LR)
    after = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    return before, after


@pytest.mark.parametrize(
    "stage, offload", W.CASES, ids=[f"zero{s}-offload_{o}" for s, o in W.CASES]
)
def test_each_stage_equals_the_full_batch_steps(ranks, stage, offload, record_equivalence):
    got = ranks[0][(stage, offload)]
    before, after = reference(stage, offload)
    assert torch.equal(got["before"], before), "the engine starts from build_model's weights"
    assert torch.equal(ranks[1][(stage, offload)]["after"], got["after"])
    # a full window of 2 micro-steps per rank, then a short one of 4 rows
    assert got["steps"] == [(24, False, 2), (4, False, 1)]
    assert got["lockstep"] == (stage == 3)
    err = update_rel_err(before, got["after"], after)
    record_equivalence(f"deepspeed zero{stage} offload {offload}", err)
    assert err <= 1e-5, err


@pytest.mark.parametrize(
    "stage, offload", W.CASES, ids=[f"zero{s}-offload_{o}" for s, o in W.CASES]
)
def test_the_weights_read_back_from_deepspeeds_files_without_its_runtime(
    ranks, tmp_path_factory, stage, offload
):
    """The checkpoint every rank wrote through DeepSpeed, read whole in this process
    (read_zero_weights: DeepSpeed's files as data, its partitions put back together), holds
    exactly the weights the ranks trained."""
    import sys

    from rayacc.engine.parallel.deepspeed import read_zero_weights
    from rayacc.models import build_model

    folder = ranks[0]["out_dir"] / f"zero{stage}-{offload}" / "zero"
    names = [n for n, _ in build_model(W.config(stage, offload), W.dataset()).named_parameters()]
    modules = set(sys.modules)
    weights = read_zero_weights(folder)
    assert not {m for m in set(sys.modules) - modules if m.startswith("deepspeed")}
    read = torch.cat([weights[n].reshape(-1).double() for n in names])
    assert torch.equal(read, ranks[0][(stage, offload)]["after"])
