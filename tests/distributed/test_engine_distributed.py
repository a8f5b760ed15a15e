"""DDP + accumulation over 2 gloo processes equals the single-process full-batch step."""

from __future__ import annotations

import pytest
import torch

from tests.support.ranks import dist_workers as W
from tests.support.ranks.engine_helpers import (
    TinyCausalLM,
    TinyClassifier,
    classification_rows,
    clone,
    full_batch_classification_loss,
    full_batch_token_loss,
    params_vector,
    reference_sgd_step,
    slice_rows,
    spawn_ranks,
    update_rel_err,
)

pytestmark = pytest.mark.distributed
WORLD = 2
FP32_TOL = 1e-6


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Runs every scenario once on 2 ranks; returns what each rank saved."""
    return spawn_ranks(W.run_rank, WORLD, tmp_path_factory.mktemp("gloo"), "2-process run")


def test_ranks_end_with_identical_weights(ranks):
    for key in ("classify", "tokens", "adamw"):
        assert torch.equal(ranks[0][key]["params"], ranks[1][key]["params"]), key


@pytest.mark.parametrize(
    ("key", "label"),
    [
        ("classify", "2 ranks × 4 micro-steps, classification, SGD"),
        # the engine's hook sums over ranks; DDP's own averages and the factor carries W
        ("default_hook", "2 ranks × 4 micro-steps, DDP's own averaging hook"),
    ],
)
def test_ddp_accumulation_equals_full_batch(ranks, record_equivalence, key, label):
    model = TinyClassifier()
    before = params_vector(model)
    reference_sgd_step(
        model, full_batch_classification_loss(model, classification_rows(W.GLOBAL_ROWS)), W.LR
    )
    err = update_rel_err(before, ranks[0][key]["params"], params_vector(model))
    record_equivalence(label, err)
    assert err <= FP32_TOL, err
    result = ranks[0][key]["result"]
    assert result.items == result.samples == W.GLOBAL_ROWS
    assert result.micro_steps == 4


def test_ranks_with_different_token_counts_give_token_mean_step(ranks, record_equivalence):
    seqs, _ = W.long_and_short_token_shards(0)
    local = [ranks[r]["tokens"]["local_tokens"] for r in range(WORLD)]
    assert local[1] > 2 * local[0], f"the ranks must hold very different token counts: {local}"
    model = TinyCausalLM()
    before = params_vector(model)
    reference_sgd_step(model, full_batch_token_loss(model, seqs), W.LR)
    err = update_rel_err(before, ranks[0]["tokens"]["params"], params_vector(model))
    record_equivalence("2 ranks, padded tokens, unequal token counts, SGD", err)
    assert err <= FP32_TOL, err
    assert ranks[0]["tokens"]["result"].items == sum(local)


def test_adamw_schedule_and_clipping_match_full_batch(ranks, record_equivalence):
    from rayacc.engine import build_scheduler

    rows = classification_rows(3 * W.GLOBAL_ROWS, seed=7)
    model = TinyClassifier()
    start = params_vector(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    sched = build_scheduler(opt, warmup_steps=1, total_steps=3, min_lr_ratio=0.1)
    for s in range(3):
        window = slice_rows(rows, s * W.GLOBAL_ROWS, (s + 1) * W.GLOBAL_ROWS)
        opt.zero_grad()
        full_batch_classification_loss(model, window).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
    err = update_rel_err(start, ranks[0]["adamw"]["params"], params_vector(model))
    record_equivalence("2 ranks, 3 AdamW steps, warmup+cosine, clipping", err)
    # Adam divides by sqrt(v): float rounding is amplified more than in SGD
    assert err <= 1e-5, err


def test_one_gradient_sync_pass_per_optimizer_step(ranks):
    sync = ranks[0]["sync"]
    k = sync["micro_steps"]
    assert k == 4
    for passes, launches in sync["engine"]:
        assert passes == 1
        assert launches > 1, "several buckets were configured"
    assert sync["plain_passes"] == k
    assert sync["plain_launches"] == k * sync["engine"][0][1]


def test_non_finite_loss_on_one_rank_skips_on_all(ranks):
    for r in range(WORLD):
        assert ranks[r]["nan"] == {"skipped": True, "reason": "non-finite loss", "unchanged": True}


def test_unequal_micro_steps_raise_on_every_rank_instead_of_hanging(ranks):
    for r in range(WORLD):
        assert "different numbers of micro-batches" in ranks[r]["mismatch"]


def test_out_of_memory_on_one_rank_halves_the_micro_batch_on_all(ranks, record_equivalence):
    for r in range(WORLD):
        oom = ranks[r]["oom"]
        assert oom["no_oom"] == {"splits": 1, "micro_steps": 4}
        assert oom["result"].micro_batch_splits == 2
        assert oom["result"].micro_steps == 8
        assert oom["result"].items == W.GLOBAL_ROWS
        assert oom["next_window"] == {"splits": 2, "micro_steps": 8}
    # rank 1 failed in its 2nd micro-step (rows 3); then every micro-batch was cut to 2 + 1
    assert ranks[1]["oom"]["calls"] == [3, 3, 2, 1, 2, 1, 2, 1, 2, 1]
    assert ranks[0]["oom"]["calls"][:1] == [3]
    assert ranks[0]["oom"]["calls"][-8:] == [2, 1] * 4
    assert torch.equal(ranks[0]["oom"]["params_after_retry"], ranks[1]["oom"]["params_after_retry"])
    model = TinyClassifier()
    before = params_vector(model)
    reference_sgd_step(
        model, full_batch_classification_loss(model, classification_rows(W.GLOBAL_ROWS)), W.LR
    )
    err = update_rel_err(before, ranks[0]["oom"]["params_after_retry"], params_vector(model))
    record_equivalence("2 ranks, out-of-memory retry at half the micro-batch, SGD", err)
    assert err <= FP32_TOL, err
    for r in range(WORLD):
        assert "CUDA out of memory" in ranks[r]["oom_plain"]


def test_window_stats_reach_all_ranks_beside_a_bf16_bucket(ranks):
    results = [ranks[r]["bf16"]["result"] for r in range(WORLD)]
    assert [r.items for r in results] == [W.GLOBAL_ROWS] * WORLD
    assert results[0].loss == results[1].loss
    assert not results[0].skipped and results[0].sync_passes == 1
    # the mean item loss over both ranks' rows, as each rank measured its own before the step
    both = sum(ranks[r]["bf16"]["local_loss_sum"] for r in range(WORLD))
    assert results[0].loss == pytest.approx(both / W.GLOBAL_ROWS, rel=1e-5)


def test_every_ranks_figures_reach_every_rank_without_a_collective_of_their_own(ranks):
    """The per-rank telemetry rides the window's reduction, as the counts do."""
    for r in range(WORLD):
        seen = ranks[r]["figures_by_rank"]
        assert seen["reported"] == ((0.5, 0.0, 7.25), (1.5, 100.0, 7.25)), seen
        assert seen["plain"] == ()
        assert seen["reported_calls"] == seen["plain_calls"] >= 1, seen
        assert seen["items"] == W.GLOBAL_ROWS  # the counts beside them still exact
        assert seen["optimizer_time_s"] > 0


def test_the_counter_records_what_a_wrong_loop_would_hide():
    """Sanity of the reference itself: a half-size global batch gives a different step."""
    model = TinyClassifier()
    ref = clone(model)
    before = params_vector(model)
    rows = classification_rows(W.GLOBAL_ROWS)
    reference_sgd_step(model, full_batch_classification_loss(model, slice_rows(rows, 0, 12)), W.LR)
    reference_sgd_step(ref, full_batch_classification_loss(ref, rows), W.LR)
    assert update_rel_err(before, params_vector(model), params_vector(ref)) > 0.01
