"""Tensor parallelism composed with FSDP's data parallelism (a 2-D mesh) and with HSDP's (3-D:
replica groups × shard groups × tensor-parallel groups), exact under accumulation: the built-in
GPT and a transformers Llama (the plan transformers declares), full and short last windows,
both FSDP sync modes, padded variable-length token rows, and resumes onto another mesh,
against the single-process full-batch steps (the combination matrix's windows and bound)."""

from __future__ import annotations

import pytest

from tests.support.ranks import matrix as M
from tests.support.ranks.engine_helpers import update_rel_err
from tests.support.ranks.tensor_parallel import PER_LAYER, TPCase, run_phase

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
    TPCase(6, 2, 2, "every_micro_step", "short", replicate=2, resume=(1, 2)),
    TPCase(7, 2, 2, "window_end", "full", replicate=2),
]
"""Two spawns of rank processes: every case's first phase on 2 × 2, the resumed ones' rest on
1 × 2 (its own tensor-parallel group alone; a mesh that grows on resume is DCP's same
resharding the other way)."""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    groups = [("A", w, [c for c in CASES if c.dp * c.tp == w]) for w in (2, 4)]
    groups += [("B", w, [c for c in CASES if c.resume and c.resume[0] * c.resume[1] == w])
               for w in (2, 4)]  # fmt: skip
    root = tmp_path_factory.mktemp("tensor_parallel")
    return M.spawn_phase_groups(root, groups, "tensor-parallel", run_phase)


@pytest.mark.parametrize("case", CASES, ids=TPCase.label)
def test_a_tensor_parallel_step_equals_the_full_batch_steps(results, case, record_equivalence):
    before, after = M.reference(case.matrix_case(), case.config())
    got = results[case.index]
    err = update_rel_err(before, got["params"], after)
    record_equivalence(f"tensor parallel: {case.label()}", err)
    assert err <= BOUND, (case.label(), err)
    dp, tp = case.resume or (case.dp, case.tp)
    if case.replicate > 1 and not case.resume:
        r = case.replicate
        assert got["mesh"] == (f"HSDP × TP mesh {r} × {dp // r} × {tp} (replica groups × "
                               "ranks sharding each × tp)")  # fmt: skip
    else:
        assert got["mesh"] == f"FSDP × TP mesh {dp} × {tp} (dp × tp)"


@pytest.mark.parametrize("case", [c for c in CASES if not c.resume], ids=TPCase.label)
def test_the_tensor_parallel_collectives_are_counted_apart(results, case):
    """`comm/tp_*`: the layers' collectives of every micro-step and the gradient norm's one
    all-reduce over `tp` (its other over `dp`, like FSDP's reduce-scatters, not counted here)."""
    allreduce, gathers = PER_LAYER[case.model]
    model = case.config().model
    layers = model.n_layer if case.model == "gpt" else model.hf.config["num_hidden_layers"]
    for calls, micro_steps in results[case.index]["calls"]:
        assert calls is not None
        expected = (micro_steps * allreduce * layers + 1, micro_steps * gathers * layers, 0)
        assert (calls.allreduce, calls.all_gather, calls.reduce_scatter) == expected, case


@pytest.mark.parametrize("case", [CASES[0], CASES[7]], ids=TPCase.label)
def test_every_rank_of_the_mesh_reports_its_figures(results, case):
    """The ranks' figures ride the window's reduction over the data-parallel ranks and one
    all-reduce over the tensor-parallel group: every rank of the mesh is seen by rank 0 (each
    reported its rank and its data-parallel rank), and its place on the mesh is known."""
    got = results[case.index]
    places = [dict(p) for p in got["places"]]
    assert len(places) == case.dp * case.tp == 4
    assert sorted((p["tp"], *[v for k, v in p.items() if k != "tp"]) for p in places) == sorted(
        {(p["tp"], *[v for k, v in p.items() if k != "tp"]) for p in places}
    )  # every place once
    from rayacc.worker.telemetry import _owners

    owners = _owners(got["places"])
    assert got["figures"] == tuple((float(r), float(owners[r])) for r in range(4))
    assert sorted(owners) == [0, 0, 1, 1]


@pytest.mark.parametrize("case", [c for c in CASES if not c.resume], ids=TPCase.label)
def test_the_memory_estimates_share_is_what_a_rank_holds(results, case):
    """`plan --memory` (and the planner's prior) count a rank's parameters as its share of
    what the plan splits plus the layers left whole, over the ranks sharding it
    (`TensorPlan.keep`): within 10 % of what rank 0 of the real mesh holds (FSDP pads its
    shards; a fused bias the plan names stays whole)."""
    from rayacc.models import build_on_meta
    from rayacc.planner.search import tensor_plan

    model = build_on_meta(case.config(), M.dataset())
    total = sum(p.numel() for p in model.parameters())
    shards = case.dp // case.replicate  # HSDP: sharded inside each replica group
    estimate = total * tensor_plan(model, 1, 4).keep(case.tp) / shards
    assert results[case.index]["held"] == pytest.approx(estimate, rel=0.1), case.label()
