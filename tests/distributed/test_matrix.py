"""Exact where features meet: the pairwise combination matrix (tests/matrix.py) against the
single-process full-batch reference, with its table printed at the end of the run.

Bounds. fp32: 1e-5 relative error of the whole update (three SGD-with-momentum steps; rounding
alone gives ~1e-7). bf16: autocast (and FSDP's bf16 parameters) round every matmul input to 8
significant bits, a relative error of at most u = 2^-8 per value. A first-order bound on the
gradient's relative error adds that of each rounded operand along the longest path — each of
the 9 linear layers (4 per block × 2 blocks + the head) rounds its two inputs in forward and
the two operands of each of its two backward matmuls — 6 roundings per layer, 54u ≈ 0.21 in the
worst case where every error points the same way; errors of independent sign add in quadrature,
so the expected error is about sqrt(54)·u ≈ 0.029. The test holds bf16 cases to sqrt(54)·u·3
≈ 0.086 (three standard deviations of the independent-sign estimate): a wrong normalisation by
a whole worker or micro-step count, a skipped window or a leaked trial gradient is ≥ 0.3.
"""

from __future__ import annotations

import math
import sys

import pytest

from tests.support.models import twin_strategy as twin
from tests.support.ranks import matrix as M
from tests.support.ranks.engine_helpers import update_rel_err
from tests.support.services.counts import note

pytestmark = pytest.mark.distributed

FP32_BOUND = 1e-5
BF16_BOUND = 3 * math.sqrt(54) * 2.0**-8


@pytest.fixture(scope="module")
def matrix_results(tmp_path_factory):
    """Every case's (case, update error, signals seen, the strategy class that ran): the
    matrix's own cases and, in the same rank groups, those a strategy added by another package
    brings (its package on sys.path, which the spawned ranks inherit)."""
    root = tmp_path_factory.mktemp("matrix")
    plugin = str(twin.write_package(tmp_path_factory.mktemp("plugin")))
    all_cases = M.cases()
    all_cases += M.added_strategy_cases(twin.NAME, first_index=len(all_cases))
    sys.path.insert(0, plugin)
    try:
        done = M.spawn_phase_groups(root, M.phase_groups(all_cases), "matrix phase")
    finally:
        sys.path.remove(plugin)
    rows = []
    for case in all_cases:
        before, after = M.reference(case)
        got = done[case.index]
        rows.append((case, update_rel_err(before, got["params"], after), got["signals"],
                     got["strategy"]))  # fmt: skip
    return rows


def test_the_cases_cover_every_accepted_pair_and_the_refused_ones_are_named():
    """The covering array is generated from the validator: a pair of values it refuses in
    every case is left out and its refusal names both factors' keys; every other pair is in a
    case; the counts are printed."""
    chosen = [dict(zip(M.FACTORS, (getattr(c, k) for k in M.FACTORS))) for c in M.cases()]
    assert M.uncovered_pairs(M.FACTORS, chosen) == []
    refused = M.refused_pairs()
    for ((a, va), (b, vb)), message in refused.items():
        assert M.KEYS[a] in message and M.KEYS[b] in message, (a, va, b, vb, message)
    assert (("loss", "chunked"), ("objective", "rows")) in refused
    # far fewer than the whole space, and no case twice
    assert len(chosen) < 20 and len({tuple(c.values()) for c in chosen}) == len(chosen)
    pairs = len(M.all_pairs(M.FACTORS))
    space = math.prod(len(v) for v in M.FACTORS.values())
    note("combination matrix: pairwise coverage",
         f"{len(chosen)} cases of {space} combinations cover all {pairs - len(refused)} "
         f"accepted pairs of values of {len(M.FACTORS)} factors; {len(refused)} pair(s) "
         "refused before launch")  # fmt: skip


def test_every_case_equals_the_full_batch_steps(matrix_results, record_equivalence):
    failures = []
    lines = [f"{'err':>9}  {'bound':>8}  " + " | ".join(M.FACTORS)]
    for case, err, _, _ in matrix_results:
        bound = BF16_BOUND if case.precision == "bf16" else FP32_BOUND
        lines.append(f"{err:9.2e}  {bound:8.1e}  {case.label()}")
        record_equivalence(f"matrix #{case.index}: {case.label()}", err)
        if not err <= bound:
            failures.append(lines[-1])
    for line in lines:
        note("combination matrix: relative update error vs single-process full batch", line)
    assert not failures, "\n".join(failures)


def test_a_signal_one_rank_raises_reaches_every_rank_in_its_window(matrix_results):
    """`AccumulationStep(signal=...)` (a preemption notice) rides the window's counts: rank 0
    counts the last rank's signal in the window it was raised, for every strategy, precision
    and worker count, and in no other window."""
    for case, _, seen, _ in matrix_results:
        windows_run = len(M.windows(case)) - (1 if case.event != "none" else 0)
        expected = [1 if i % 2 == 0 else 0 for i in range(windows_run)]
        assert seen == expected, (case.label(), seen, expected)


def test_a_strategy_added_by_another_package_passes_the_matrix(matrix_results):
    """docs/design.md, "How to add …": one module and one matrix value. A second DDP in a
    package of its own, registered by entry point and named by no file of rayacc, brings its
    pairs with every other factor (every worker count, both phases of a resume) and each equals
    the single-process full-batch steps, within the bounds above; the ranks ran its class."""
    added = [row for row in matrix_results if row[0].strategy == twin.NAME]
    assert {case.workers for case, *_ in added} == set(M.FACTORS["workers"])
    assert {case.event for case, *_ in added} == set(M.FACTORS["event"])
    for case, err, _, ran in added:
        assert ran == twin.CLASS, (case.label(), ran)
        assert err <= (BF16_BOUND if case.precision == "bf16" else FP32_BOUND), case.label()
    mine = [ran for case, *_, ran in matrix_results if case.strategy != twin.NAME]
    assert twin.CLASS not in mine
