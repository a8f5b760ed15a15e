"""Tensor parallelism composed with FSDP's data parallelism (a 2-D mesh), exact under
accumulation: the built-in GPT and a transformers Llama (the plan transformers declares), full
and short last windows, both FSDP sync modes, padded variable-length token rows, and resumes
onto another mesh, against the single-process full-batch steps (the combination matrix's
windows and bound)."""

from __future__ import annotations

import functools

import pytest

from tests.support.ranks import matrix as M
from tests.support.ranks.engine_helpers import spawn_ranks, update_rel_err
from tests.support.ranks.tensor_parallel import TPCase, run_group

pytestmark = pytest.mark.distributed

BOUND = 1e-5
"""The matrix's fp32 bound on the update's relative error (rounding alone gives ~1e-7)."""

CASES = [
    TPCase(0, 2, 2, "every_micro_step", "full"),
    TPCase(1, 2, 2, "window_end", "short"),
    TPCase(2, 2, 2, "window_end", "full", resume=(1, 2)),
    TPCase(3, 2, 2, "every_micro_step", "short", resume=(1, 2)),
    TPCase(4, 2, 2, "window_end", "short", model="llama"),
    TPCase(5, 2, 2, "every_micro_step", "full", model="llama", resume=(1, 2)),
]
"""Two spawns of rank processes: every case's first phase on 2 × 2, the resumed ones' rest on
1 × 2 (its own tensor-parallel group alone; a mesh that grows on resume is DCP's same
resharding the other way)."""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("tensor_parallel")
    done: dict[int, dict] = {}
    groups = [("A", w, [c for c in CASES if c.dp * c.tp == w]) for w in (2, 4)]
    groups += [("B", w, [c for c in CASES if c.resume and c.resume[0] * c.resume[1] == w])
               for w in (2, 4)]  # fmt: skip
    for phase, world, chosen in groups:
        if not chosen:
            continue
        folder = root / f"{phase}{world}"
        folder.mkdir()
        target = functools.partial(run_group, phase=phase, chosen=chosen)
        ranks = spawn_ranks(target, world, folder, f"tensor-parallel {phase} on {world} ranks")
        assert "error" not in ranks[0], ranks[0].get("error")
        done.update({i: v for i, v in ranks[0].items() if isinstance(i, int)})
    return done


@pytest.mark.parametrize("case", CASES, ids=TPCase.label)
def test_a_tensor_parallel_step_equals_the_full_batch_steps(results, case, record_equivalence):
    before, after = M.reference(case.matrix_case(), case.config())
    got = results[case.index]
    err = update_rel_err(before, got["params"], after)
    record_equivalence(f"tensor parallel: {case.label()}", err)
    assert err <= BOUND, (case.label(), err)
    dp, tp = case.resume or (case.dp, case.tp)
    assert got["mesh"] == f"FSDP × TP mesh {dp} × {tp} (dp × tp)"
