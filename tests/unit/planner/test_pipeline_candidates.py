"""The planner's pipeline degree: candidates with stages under the strategies that compose with
a pipeline, the model's `PipelinePlan`, the prior's stage share, idle share, activations in
flight and sends, and the config's rules judging each candidate (the planner keeps no list of
its own of what a pipeline refuses)."""

from __future__ import annotations

import pytest

from rayacc.config import TrainConfig
from rayacc.config.mesh import Mesh
from rayacc.config.strategies import strategies
from rayacc.planner.candidates import Candidate, enumerate_candidates, with_candidate
from rayacc.planner.prior import PipelinePlan, Placement, predict
from rayacc.planner.profile import Curve, Profile

MIB = 2**20


def _profile(**kw) -> Profile:
    base = dict(
        device="cpu",
        world=4,
        param_bytes=8 * MIB,
        units=6,
        largest_unit_bytes=2 * MIB,
        optimizer_slots=2,
        compute_s={"none": Curve([1, 64], [0.011, 0.074])},
        activation_bytes={"none": Curve([1, 64], [0.1 * MIB, 6.4 * MIB])},
        optimizer_s=0.004,
        allreduce_s_per_byte=1e-8,
        gather_s_per_byte=0.5e-8,
        latency_s=1e-4,
    )
    base.update(kw)
    return Profile(**base)


def _gpt_job(tmp_path, **batch) -> TrainConfig:
    from tests.support.data.tokens import token_data

    info = token_data(tmp_path, "ids")
    gpt = {"name": "gpt", "n_layer": 4, "n_head": 2, "n_embd": 32, "block_size": 8}
    return TrainConfig.from_dict(
        {
            "model": gpt,
            "data": {"source": info.path, "seq_len": 8},
            "batch": {"global_batch_size": 16, **batch},
            "train": {"strategy": "fsdp"},
            "scaling": {"num_workers": 4},
        }
    ), info


def test_pipeline_candidates_come_from_the_wings_that_compose_with_a_pipeline():
    """Stage counts the model takes that divide the workers (after any tensor-parallel
    groups), under each strategy the registry says composes with a pipeline, in the window-end
    mode alone (a pipeline's stages reduce once a window whatever the mode) and never
    offloaded; the global batch splits over the ranks left."""
    cands, _ = enumerate_candidates(64, [2, 3, 4], 2, pipeline=[2, 4], tensor_parallel=[2])
    piped = [c for c in cands if c.pipeline_parallel > 1]
    composing = {n for n, e in strategies().items() if e.without_pipeline_parallel is None}
    assert piped and {c.strategy for c in piped} == composing
    assert {(c.workers, c.tensor_parallel, c.pipeline_parallel) for c in piped} == {
        (2, 1, 2), (4, 1, 2), (4, 1, 4), (4, 2, 2)}  # fmt: skip
    assert all(c.grad_sync == "window_end" and not c.offload for c in piped)
    assert all(c.global_batch_size == 64 for c in cands)
    key = (4, 1, 2, 8, "none")
    (c,) = [c for c in piped if (c.workers, c.tensor_parallel, c.pipeline_parallel,
                                 c.micro_batch_size, c.checkpointing) == key]  # fmt: skip
    assert (c.data_parallel, c.grad_accum_steps) == (2, 4)
    assert c.label == "4w 8×4 fsdp window_end pp2 ac=none"
    over = c.overrides()
    for degree, value in {"pipeline": 2, "tensor": 1, "schedule": "1f1b"}.items():
        assert over[Mesh.key(degree)] == value
    # without stage counts: the candidates there were before
    plain, _ = enumerate_candidates(64, [2, 3, 4], 2, tensor_parallel=[2])
    assert plain == [c for c in cands if c.pipeline_parallel == 1]


def test_the_pipeline_plan_of_the_gpt(tmp_path):
    """The fullest rank's share of each stage count the model takes (its units: the
    embeddings, each block, the norm and head) and the hidden states one stage sends the next;
    a model that declares no split has none."""
    from rayacc.models.registry import build_on_meta
    from rayacc.planner.search import pipeline_plan, pipeline_share

    cfg, info = _gpt_job(tmp_path)
    model = build_on_meta(cfg, info)
    plan = pipeline_plan(model, tokens=8, value_bytes=4, most=16)
    assert sorted(plan.shares) == [2, 4]  # 6 units: 8 stages would leave some empty
    for p, share in plan.shares.items():
        assert share == pipeline_share(model, Mesh(p))
        assert 1 / p <= share < 1
    assert plan.bytes_per_sample == 8 * 32 * 4
    assert pipeline_plan(model, 8, 4, most=1) is None
    from rayacc.data.bundled import prepare_bundled
    from rayacc.data.sources import describe_dataset

    mlp = TrainConfig.from_dict({"batch": {"global_batch_size": 8}})
    digits = describe_dataset(str(prepare_bundled("digits")))
    assert pipeline_plan(build_on_meta(mlp, digits), 1, 4, most=4) is None


def test_the_prior_counts_a_stages_share_its_idle_time_its_activations_in_flight_and_sends():
    p = _profile()
    plan = PipelinePlan(shares={2: 0.6}, bytes_per_sample=1000.0)
    flat = Candidate(4, 4, 4, "fsdp", "window_end")
    piped = Candidate(4, 8, 4, "fsdp", "window_end", pipeline_parallel=2)  # the same batch
    f, s = predict(flat, p), predict(piped, p, pipeline_plan=plan)
    # a stage's share of the micro-batches' compute, stretched by 1F1B's idle share
    bubble = (2 - 1) / (4 + 2 - 1)
    assert s.compute_s == pytest.approx(4 * p.compute_s["none"].at(8) * 0.6 / (1 - bubble))
    # its share of the parameters, sharded over the 2 ranks of its stage (window_end: its
    # gradients whole across the window; on a CPU its units gathered whole), and the
    # activations of the 2 micro-batches 1F1B holds in flight
    P = 8 * MIB * 0.6
    activations = p.activation_bytes["none"].at(8) * 0.6 * 2
    assert s.memory_bytes == pytest.approx((1 + 2) * P / 2 + P + P + activations)
    assert f.memory_bytes == pytest.approx((1 + 2) * 8 * MIB / 4 + 2 * 8 * MIB
                                           + p.activation_bytes["none"].at(4))  # fmt: skip
    # each micro-batch's hidden states sent on and their gradient back: 2 sends a micro-step,
    # each the cost of a 2-rank all-reduce of its bytes (scaled from the profile's 4 ranks)
    no_sends = predict(piped, p, pipeline_plan=PipelinePlan({2: 0.6}, 0.0))
    assert s.comm_s - no_sends.comm_s == pytest.approx(2 * 4 * 8 * 1000.0 * 1e-8 * 0.5 / 0.75)
    with pytest.raises(ValueError, match="needs the model's PipelinePlan"):
        predict(piped, p)
    # slow links between nodes slow the sends, not the compute
    slow = Placement(workers_per_node=2, inter_node_gbps=0.1)
    far = predict(piped, p, pipeline_plan=plan, placement=slow)
    assert far.compute_s == s.compute_s and far.comm_s > s.comm_s


def test_the_rules_judge_each_pipeline_candidate(tmp_path):
    """What a pipeline does not compose with is the config's to say: a job whose global batch
    follows a schedule keeps no pipeline candidate — left out with the rule's words and a
    candidate named; the others stay."""
    from rayacc.planner.search import judged_by_the_rules

    cfg, _ = _gpt_job(tmp_path)
    cands, _ = enumerate_candidates(16, [4], 4, pipeline=[2])
    kept, lines = judged_by_the_rules(cfg, cands)
    assert kept == cands and lines == []
    piped = next(c for c in cands if c.pipeline_parallel == 2)
    assert with_candidate(cfg, piped).mesh == Mesh(2)
    (tmp_path / "phases").mkdir()
    phases, _ = _gpt_job(
        tmp_path / "phases", schedule=[{"from_samples": 64, "global_batch_size": 32}]
    )
    kept, lines = judged_by_the_rules(phases, cands)
    assert kept == [c for c in cands if c.pipeline_parallel == 1]
    assert len(lines) == 1 and lines[0].startswith("pipelines of 2 stages (4w "), lines
    assert "batch.schedule" in lines[0], lines
