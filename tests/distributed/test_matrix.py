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

import functools
import math

import pytest
import torch

from tests.support.ranks import matrix as M
from tests.support.ranks.engine_helpers import spawn_ranks, update_rel_err
from tests.support.services.counts import note

pytestmark = pytest.mark.distributed

FP32_BOUND = 1e-5
BF16_BOUND = 3 * math.sqrt(54) * 2.0**-8


@pytest.fixture(scope="module")
def matrix_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix")
    all_cases = M.cases()
    finals: dict[int, torch.Tensor] = {}
    signals: dict[int, list[int]] = {}
    for phase, world, chosen in M.phase_groups(all_cases):
        folder = root / f"{phase}{world}"
        folder.mkdir()
        target = functools.partial(M.run_group, phase=phase, indices=[c.index for c in chosen])
        ranks = spawn_ranks(target, world, folder, f"matrix phase {phase} on {world} ranks")
        assert "error" not in ranks[0], ranks[0].get("error")
        finals.update({i: v["params"] for i, v in ranks[0].items() if isinstance(i, int)})
        signals.update({i: v["signals"] for i, v in ranks[0].items() if isinstance(i, int)})
    rows = []
    for case in all_cases:
        before, after = M.reference(case)
        rows.append((case, update_rel_err(before, finals[case.index], after), signals[case.index]))
    return rows


def test_the_cases_cover_every_pair_of_values():
    chosen = [dict(zip(M.FACTORS, (getattr(c, k) for k in M.FACTORS))) for c in M.cases()]
    assert M.uncovered_pairs(M.FACTORS, chosen) == []
    # far fewer than the whole space, and no case twice
    assert len(chosen) < 20 and len({tuple(c.values()) for c in chosen}) == len(chosen)


def test_every_case_equals_the_full_batch_steps(matrix_results, record_equivalence):
    failures = []
    lines = [f"{'err':>9}  {'bound':>8}  " + " | ".join(M.FACTORS)]
    for case, err, _ in matrix_results:
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
    for case, _, seen in matrix_results:
        windows_run = len(M.windows(case)) - (1 if case.event != "none" else 0)
        expected = [1 if i % 2 == 0 else 0 for i in range(windows_run)]
        assert seen == expected, (case.label(), seen, expected)
