"""Fine-tuning's one rule on gloo ranks: with a loss mask counting 1 token in one row and every
token in the next, the step divides by the global count of counted targets under every
strategy, with LoRA adapters (the base frozen, out of the optimizer) and with the user's
objective (`train.loss`), and equals the single-process full-batch step
(tests/support/ranks/finetune_matrix.py)."""

from __future__ import annotations

import pytest
import torch

from tests.support.ranks import finetune_matrix as F
from tests.support.ranks.engine_helpers import spawn_ranks, update_rel_err
from tests.support.services.counts import note

pytestmark = pytest.mark.distributed
pytest.importorskip("deepspeed")
pytest.importorskip("peft")

BOUND = 1e-5


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = spawn_ranks(
        F.run_rank, 2, tmp_path_factory.mktemp("finetune"), "fine-tuning cases", deadline_s=400
    )
    for r in out:
        assert "error" not in r, r.get("error")
    return out


def test_the_cases_cover_every_strategy_adapters_and_the_objective():
    cases = F.cases()
    assert {c.strategy for c in cases if c.loss == "weighted"} == set(F.WEIGHTED_UNDER)
    assert {c.strategy for c in cases} == set(F.STRATEGIES)
    assert {c.strategy for c in cases if c.adapters == "lora"} == set(F.STRATEGIES) - {"fsdp × tp"}
    assert {c.strategy for c in cases if c.loss == "objective"} == set(F.STRATEGIES)


def test_the_masks_count_very_unevenly_per_micro_batch():
    """The case the per-micro-batch mean gets wrong: the first window's micro-batches (rows in
    pairs) count targets several times apart."""
    per_row = [int(m[1:].sum()) for m in F.rows()[1]][: F.WINDOWS[0]]
    assert sum(int(d[-1]) for d in F.rows()[2]) >= 4, "packed rows among them"
    per_micro = [a + b for a, b in zip(per_row[0::2], per_row[1::2])]
    assert min(per_row) == 1 and max(per_micro) >= 3 * min(per_micro), per_micro


def test_every_case_equals_the_full_batch_step(ranks, record_equivalence):
    failures = []
    for case in F.cases():
        got = ranks[0][case.index]
        assert torch.equal(got["after"], ranks[1][case.index]["after"]), case.label()
        windows = [(0, F.WINDOWS[0]), (F.WINDOWS[0], sum(F.WINDOWS))]
        expected = [F.counted(lo, hi, case.loss) for lo, hi in windows]
        assert got["items"] == pytest.approx(expected, rel=1e-6), case.label()
        if case.loss == "weighted":  # a sum of weights: a real, not truncated
            assert all(isinstance(i, float) and not i.is_integer() for i in got["items"])
        before, after = F.reference(case)
        err = update_rel_err(before, got["after"], after)
        record_equivalence(
            f"fine-tuning: {case.label()} (masked rows, a full and a short window)", err
        )
        note("fine-tuning matrix: relative update error vs single-process full batch",
             f"{err:9.2e}  {case.label()}")  # fmt: skip
        if not err <= BOUND:
            failures.append(f"{case.label()}: {err:.2e}")
    assert not failures, failures


def test_adapters_leave_the_base_as_it_was(ranks):
    """Only adapter weights move: the frozen base's entries of the weights are the start's."""
    from rayacc.models import build_model

    for case in F.cases():
        if case.adapters != "lora":
            continue
        model = build_model(F.config(case), F.dataset())
        start = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
        frozen = torch.cat(
            [torch.full((p.numel(),), not p.requires_grad) for p in model.parameters()]
        )
        after = ranks[0][case.index]["after"]
        assert torch.equal(after[frozen], start[frozen]), case.label()
        assert not torch.equal(after[~frozen], start[~frozen]), case.label()
