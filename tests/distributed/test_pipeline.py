"""Pipeline parallelism, exact under accumulation: the built-in GPT cut into stages by its
units (embeddings, blocks, head; the tied head a copy of its own on the last stage), each
schedule (GPipe, 1F1B, Interleaved1F1B, ZBV) on 2 pipeline ranks, pipeline × FSDP's data
parallelism on 2 × 2, × HSDP's on 2 × 2 × 1 and × tensor parallelism on 2 × 1 × 2, full and
short last windows, clipping on the norm over every stage, resumes onto other meshes, a user
objective counting rows (it never sees the padding of a short window), LoRA adapters on the
stages (the base, tied weights included, frozen), against the
single-process full-batch steps (the combination matrix's windows and bound)."""

from __future__ import annotations

import pytest

from tests.support.ranks import matrix as M
from tests.support.ranks.engine_helpers import update_rel_err
from tests.support.ranks.pipeline import PPCase, reference, run_phase
from tests.support.ranks.tensor_parallel import PER_LAYER

pytestmark = pytest.mark.distributed

BOUND = 1e-5
"""The matrix's fp32 bound on the update's relative error (rounding alone gives ~1e-7)."""

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv")
CASES = [
    *(
        PPCase(i, 2, 1, s, last)
        for i, (s, last) in enumerate((s, last) for s in SCHEDULES for last in ("full", "short"))
    ),
    PPCase(8, 2, 1, "1f1b", "short", clip=0.5),
    PPCase(9, 2, 2, "1f1b", "full"),
    PPCase(10, 2, 2, "interleaved_1f1b", "short"),
    PPCase(12, 2, 1, "interleaved_1f1b", "short", epochs=2),
    PPCase(14, 2, 2, "1f1b", "short", resume=(2, 1)),
    PPCase(15, 2, 2, "interleaved_1f1b", "full", resume=(1, 2)),
    PPCase(16, 1, 2, "1f1b", "short", resume=(2, 1)),
    PPCase(17, 2, 1, "1f1b", "short", clip=0.5, tp=2),
    PPCase(18, 2, 1, "interleaved_1f1b", "full", tp=2, resume=(2, 1)),
    PPCase(19, 2, 2, "1f1b", "short", replicate=2, resume=(2, 1)),
    PPCase(20, 2, 2, "gpipe", "full", clip=0.5, replicate=2),
    PPCase(21, 2, 1, "1f1b", "short", model="llama"),
    PPCase(22, 2, 1, "interleaved_1f1b", "full", model="llama tied"),
    PPCase(23, 2, 2, "gpipe", "short", model="llama tied", resume=(1, 2)),
    PPCase(24, 2, 2, "1f1b", "short", tp=2),
    PPCase(25, 2, 1, "gpipe", "full", recompute=True),
    PPCase(26, 2, 1, "1f1b", "short", loss="rows"),
    PPCase(27, 2, 2, "interleaved_1f1b", "short", loss="rows"),
    # 5 micro-batches: torch's looped schedules take a multiple of their rounds (5 // 2)
    PPCase(28, 2, 1, "interleaved_1f1b", "full", rows=(10, 10, 7)),
    PPCase(29, 2, 1, "1f1b", "short", lora=True, clip=0.5),
    PPCase(30, 2, 2, "interleaved_1f1b", "short", lora=True),
    PPCase(31, 2, 2, "gpipe", "full", lora=True, model="llama tied"),
]
"""One spawn of rank processes per rank count and phase: 2 (pipeline ranks alone), 4 (2 × 2),
8 (2 × 2 × 2: fractional cores), and the resumed cases' second phase on 2."""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    groups = [("A", w, [c for c in CASES if c.world == w]) for w in (2, 4, 8)]
    groups += [("B", 2, [c for c in CASES if c.resume])]
    return M.spawn_phase_groups(tmp_path_factory.mktemp("pipeline"), groups, "pipeline", run_phase)


@pytest.mark.parametrize("case", CASES, ids=PPCase.label)
def test_a_pipeline_step_equals_the_full_batch_steps(results, case, record_equivalence):
    before, after, norms, val = reference(case)
    got = results[case.index]
    err = update_rel_err(before, got["params"], after)
    record_equivalence(f"pipeline parallel: {case.label()}", err)
    assert err <= BOUND, (case.label(), err)
    # the norm over every stage's gradients, the tied weight counted once
    assert got["grad_norm"] == pytest.approx(norms[1:] if case.resume else norms, rel=1e-5)
    # the tied head's copy on the last stage steps as the embedding does
    assert got["tied_gap"] < 1e-6
    assert got["recomputed"] == case.recompute
    pp, dp = case.mesh("B")
    # the forwards alone (validation's path) give the trained model's loss
    if pp > 1:
        assert got["val_loss"] == pytest.approx(val, rel=1e-5)
    stages = pp * (2 if case.schedule in ("interleaved_1f1b", "zbv") else 1)
    if pp > 1 and case.replicate > 1 and not case.resume:
        shards = dp // case.replicate
        assert got["mesh"].startswith(f"HSDP × PP mesh {pp} × {case.replicate} × {shards} "
                                      "(pp × replicate × shard)")  # fmt: skip
    elif pp > 1 and (case.tp == 1 or case.resume):
        assert got["mesh"].startswith(f"FSDP × PP mesh {pp} × {dp} (pp × dp); "
                                      f"{stages} stages by {case.schedule}")  # fmt: skip
    elif pp > 1:
        assert got["mesh"].startswith(f"FSDP × PP × TP mesh {pp} × {dp} × {case.tp} "
                                      f"(pp × dp × tp); {stages} stages")  # fmt: skip


def test_the_window_counts_every_item_once(results):
    """Only the last stage counts the items and samples; the window's sums over every rank of
    every stage count each once (a short last window its 7 rows, whatever it is padded to)."""
    for case in CASES:
        got = results[case.index]
        windows = case.windows()[1:] if case.resume else case.windows()
        assert got["items"] == [case.items(w) for w in windows], case.label()
        assert got["samples"] == [len(w) for w in windows], case.label()


@pytest.mark.parametrize("case", [c for c in CASES if not c.resume and not c.rows],
                         ids=PPCase.label)  # fmt: skip
def test_a_stage_counts_its_sends_and_its_idle_time(results, case):
    """`comm/p2p_sends`: rank 0's tensors sent to the other rank each window — a forward
    activation per micro-batch from each stage before the last, a gradient per micro-batch
    back from each stage after the first (rank 0 holds stage 0, with stage 2 of a loop or
    stage 3 of the V); `perf/pipeline_idle_frac` its idle share, against the schedule's
    (P − 1) / (v·m + P − 1)."""
    m = 12 // (case.dp * 2)  # a full window's micro-batches of 2 rows
    v = 2 if case.schedule in ("interleaved_1f1b", "zbv") else 1
    sends = {"interleaved_1f1b": 3 * m, "zbv": 2 * m}.get(case.schedule, m)
    for stats, step_s in results[case.index]["pipeline"]:
        assert stats.p2p_sends == sends, case.label()
        assert stats.bubble == pytest.approx((case.pp - 1) / (v * m + case.pp - 1))
        assert 0.0 <= stats.idle_s < step_s


@pytest.mark.parametrize("case", [c for c in CASES if c.pp > 1 and not c.resume],
                         ids=PPCase.label)  # fmt: skip
def test_a_stages_rows_are_padded_to_the_datas_longest_not_the_models(results, case):
    """The stages' buffers take the data's longest row (its input tokens), not the longest
    sequence the model takes: the Llama cases take 4 × more positions than the data holds."""
    assert results[case.index]["width"] == M.BLOCK, case.label()


@pytest.mark.parametrize("case", [c for c in CASES if c.tp > 1 and not c.resume],
                         ids=PPCase.label)  # fmt: skip
def test_a_stages_tensor_parallel_collectives_are_counted(results, case):
    """`comm/tp_*` inside a pipeline: the tensor-parallel layers of rank 0's stages, every
    micro-batch the schedule runs (a short last window's filled ones too), and the gradient
    norm's one all-reduce over `tp` — counted from the second window (the first infers the
    stages' shapes with forwards of its own)."""
    allreduce, gathers = PER_LAYER[case.model]
    got = results[case.index]
    (first, full), *rest = got["calls"]
    assert first is None and rest, "the first window is not counted"
    for calls, _ in rest:
        layers = got["blocks"] * full
        assert (calls.allreduce, calls.all_gather, calls.reduce_scatter) == (
            allreduce * layers + 1, gathers * layers, 0), case.label()  # fmt: skip


@pytest.mark.parametrize("case", [c for c in CASES if not c.resume and c.tp == 1],
                         ids=PPCase.label)  # fmt: skip
def test_the_memory_estimates_share_is_what_the_fullest_rank_holds(results, case):
    """`plan --memory` counts a pipeline rank's parameters as the fullest rank's share of the
    stages (`pipeline_share`), sharded over its data-parallel ranks: within 5 % of what the
    fullest rank of the real mesh holds (FSDP pads its shards)."""
    from rayacc.config.mesh import Mesh
    from rayacc.models import build_on_meta
    from rayacc.planner.search import pipeline_share
    from tests.support.ranks import matrix as M

    cfg = case.config()
    model = build_on_meta(cfg, M.dataset())
    total = sum(p.numel() for p in model.parameters())
    shards = case.dp // case.replicate  # HSDP: sharded inside each replica group
    estimate = total * pipeline_share(model, Mesh(case.pp, schedule=case.schedule)) / shards
    assert max(results[case.index]["held"]) == pytest.approx(estimate, rel=0.05), case.label()
