"""Single-process equivalence: an accumulated step equals one step on the whole global batch."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from rayacc.engine import (
    AccumulationStep,
    TrainState,
    build_scheduler,
    classification_item_losses,
    count_target_tokens,
    token_item_losses,
)
from tests.support.ranks.engine_helpers import (
    TinyCausalLM,
    TinyClassifier,
    classification_rows,
    clone,
    full_batch_classification_loss,
    full_batch_token_loss,
    micro_batches,
    params_vector,
    reference_sgd_step,
    slice_rows,
    token_micro_batches,
    token_sequences,
    update_rel_err,
)

LR = 0.5
FP32_TOL = 1e-6


def sgd_engine(model, **kw) -> AccumulationStep:
    return AccumulationStep(model, torch.optim.SGD(model.parameters(), lr=LR), **kw)


@pytest.mark.parametrize("micro", [1, 3, 6, 8, 24])
def test_k_micro_batches_equal_one_batch(micro, record_equivalence):
    rows = classification_rows(24)
    model = TinyClassifier()
    ref = clone(model)
    before = params_vector(model)

    result = sgd_engine(model)(micro_batches(rows, micro), classification_item_losses)
    reference_sgd_step(ref, full_batch_classification_loss(ref, rows), LR)

    err = update_rel_err(before, params_vector(model), params_vector(ref))
    record_equivalence(f"1 process, micro {micro} × {math.ceil(24 / micro)} micro-steps, SGD", err)
    assert err <= FP32_TOL, err
    assert result.micro_steps == math.ceil(24 / micro)
    assert result.items == result.samples == 24
    with torch.no_grad():
        expected_loss = float(full_batch_classification_loss(clone(TinyClassifier()), rows))
    assert result.loss == pytest.approx(expected_loss, rel=1e-6)
    assert not result.skipped


def test_padded_tokens_give_token_mean_step(record_equivalence):
    seqs = token_sequences(16)
    lengths = {len(s) for s in seqs}
    assert len(lengths) > 3, "the test needs sequences of many lengths"
    model = TinyCausalLM()
    ref = clone(model)
    before = params_vector(model)

    result = sgd_engine(model)(token_micro_batches(seqs, 4), token_item_losses, count_target_tokens)
    reference_sgd_step(ref, full_batch_token_loss(ref, seqs), LR)

    assert result.items == sum(len(s) - 1 for s in seqs)
    err = update_rel_err(before, params_vector(model), params_vector(ref))
    record_equivalence("1 process, padded token sequences, 4 micro-steps", err)
    assert err <= FP32_TOL, err


def mean_of_micro_means_step(model, microbatches, k):
    """The common mistake: each micro-step's loss is its own token mean, divided by k."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt.zero_grad()
    for mb in microbatches:
        logits = model(mb["input"])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), mb["target"].reshape(-1))
        (loss / k).backward()
    opt.step()


def test_mean_of_micro_means_fails_the_same_test(record_equivalence):
    seqs = token_sequences(16)
    model = TinyCausalLM()
    ref = clone(model)
    before = params_vector(model)

    mean_of_micro_means_step(model, token_micro_batches(seqs, 4), k=4)
    reference_sgd_step(ref, full_batch_token_loss(ref, seqs), LR)

    err = update_rel_err(before, params_vector(model), params_vector(ref))
    record_equivalence("WRONG RULE (expected large): mean of micro-means, padded tokens", err)
    assert err > 100 * FP32_TOL, f"the wrong rule went unnoticed (rel err {err})"


def test_last_short_window_uses_its_real_size(record_equivalence):
    """30 rows, global batch 12: windows of 12, 12 and a short 6; each equals its full batch."""
    rows = classification_rows(30)
    model = TinyClassifier()
    ref = clone(model)
    step = sgd_engine(model)
    windows = [slice_rows(rows, 0, 12), slice_rows(rows, 12, 24), slice_rows(rows, 24, 30)]
    for w in windows:
        before = params_vector(model)
        result = step(micro_batches(w, 3), classification_item_losses)
        reference_sgd_step(ref, full_batch_classification_loss(ref, w), LR)
        err = update_rel_err(before, params_vector(model), params_vector(ref))
        record_equivalence(f"1 process, windows 12/12/6: this one {result.samples} rows", err)
        assert err <= FP32_TOL, err
    assert result.micro_steps == 2 and result.samples == 6


def test_short_window_divided_by_configured_k_fails():
    """Scaling the short window by the configured accumulation (4) instead of its real size."""
    rows = slice_rows(classification_rows(30), 24, 30)
    model = TinyClassifier()
    ref = clone(model)
    before = params_vector(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for mb in micro_batches(rows, 3):
        (full_batch_classification_loss(model, mb) / 4).backward()
    opt.step()
    reference_sgd_step(ref, full_batch_classification_loss(ref, rows), LR)
    assert update_rel_err(before, params_vector(model), params_vector(ref)) > 0.1


def test_clipping_applies_to_the_whole_window(record_equivalence):
    rows = classification_rows(24)
    model = TinyClassifier()
    ref = clone(model)
    before = params_vector(model)
    result = sgd_engine(model, max_grad_norm=0.05)(
        micro_batches(rows, 6), classification_item_losses
    )
    reference_sgd_step(ref, full_batch_classification_loss(ref, rows), LR, max_grad_norm=0.05)
    assert result.grad_norm > 0.05, "clipping must be active for this test to mean anything"
    err = update_rel_err(before, params_vector(model), params_vector(ref))
    record_equivalence("1 process, clipped window", err)
    assert err <= FP32_TOL, err


FP16_TOL = 5e-3
BF16_TOL = 3e-2


def test_fp16_grad_scaler_path_unscales_before_clipping(record_equivalence):
    rows = classification_rows(24)
    model = TinyClassifier()
    ref = clone(model)
    before = params_vector(model)
    # init_scale small enough not to overflow on the first step
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    step = sgd_engine(model, precision="fp16", max_grad_norm=0.05, scaler=scaler)
    result = step(micro_batches(rows, 6), classification_item_losses)
    ref_norm = reference_sgd_step(
        ref, full_batch_classification_loss(ref, rows), LR, max_grad_norm=0.05
    )

    assert not result.skipped
    # the norm is of the unscaled gradient: close to the fp32 norm, not 1024 times it
    assert result.grad_norm == pytest.approx(ref_norm, rel=FP16_TOL)
    err = update_rel_err(before, params_vector(model), params_vector(ref))
    record_equivalence(f"1 process, fp16 + GradScaler + clipping (tol {FP16_TOL})", err)
    assert err <= FP16_TOL, err


def test_fp16_overflow_skips_step_and_holds_the_schedule():
    rows = classification_rows(24)
    model = TinyClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = build_scheduler(opt, warmup_steps=4, total_steps=10)
    lr0 = opt.param_groups[0]["lr"]
    # a scale this large overflows fp16 activation gradients
    step = AccumulationStep(
        model,
        opt,
        scheduler=sched,
        precision="fp16",
        scaler=torch.amp.GradScaler("cpu", init_scale=2.0**40),
    )
    before = params_vector(model)
    state = TrainState()
    result = step(micro_batches(rows, 6), classification_item_losses)
    state.advance(samples=result.samples, items=result.items, skipped=result.skipped)

    assert result.skipped and result.skip_reason == "fp16 gradient overflow"
    assert torch.equal(params_vector(model), before)
    assert sched.last_epoch == 0 and opt.param_groups[0]["lr"] == lr0
    assert state.skipped_steps == 1 and state.optimizer_step == 1


def test_bf16_within_tolerance(record_equivalence):
    rows = classification_rows(24)
    model = TinyClassifier()
    ref = clone(model)
    before = params_vector(model)
    result = sgd_engine(model, precision="bf16")(micro_batches(rows, 6), classification_item_losses)
    reference_sgd_step(ref, full_batch_classification_loss(ref, rows), LR)
    err = update_rel_err(before, params_vector(model), params_vector(ref))
    record_equivalence(f"1 process, bf16 autocast (tol {BF16_TOL})", err)
    assert not result.skipped
    assert err <= BF16_TOL, err


def test_non_finite_loss_skips_and_counts():
    rows = classification_rows(24)
    model = TinyClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = build_scheduler(opt, warmup_steps=0, total_steps=10)
    step = AccumulationStep(model, opt, scheduler=sched)
    calls = []

    def nan_on_second(m, batch):
        calls.append(1)
        losses = classification_item_losses(m, batch)
        return losses * float("nan") if len(calls) == 2 else losses

    before = params_vector(model)
    result = step(micro_batches(rows, 6), nan_on_second)
    assert len(calls) == 4, "every micro-step still runs (keeps ranks in step)"
    assert result.skipped and result.skip_reason == "non-finite loss"
    assert math.isnan(result.loss)
    assert torch.equal(params_vector(model), before)
    assert sched.last_epoch == 0
    ok = step(micro_batches(rows, 6), classification_item_losses)
    assert not ok.skipped and sched.last_epoch == 1


def test_result_reports_lr_of_the_step_and_scheduler_advances_once_per_window():
    rows = classification_rows(24)
    model = TinyClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = build_scheduler(opt, warmup_steps=4, total_steps=8, min_lr_ratio=0.0)
    step = AccumulationStep(model, opt, scheduler=sched)
    lrs = [step(micro_batches(rows, 6), classification_item_losses).lr for _ in range(3)]
    assert lrs == pytest.approx([0.25, 0.5, 0.75])


def test_single_process_has_no_gradient_sync():
    rows = classification_rows(12)
    result = sgd_engine(TinyClassifier())(micro_batches(rows, 6), classification_item_losses)
    assert result.allreduce_calls == 0 and result.sync_passes == 0
    assert result.peak_memory_mb > 0
    assert 0 <= result.sync_time_frac <= 1


def test_window_without_loss_items_is_skipped():
    seqs = [torch.tensor([3, 4])]
    model = TinyCausalLM()
    before = params_vector(model)
    batch = token_micro_batches(seqs, 1)[0]
    batch["target"][:] = -100
    result = sgd_engine(model)([batch], token_item_losses, count_target_tokens)
    assert result.skipped and result.items == 0
    assert torch.equal(params_vector(model), before)


def test_rejects_unknown_precision_and_bad_clip():
    model = TinyClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises(ValueError, match="precision=.fp8. is not one of"):
        AccumulationStep(model, opt, precision="fp8")
    with pytest.raises(ValueError, match="max_grad_norm must be > 0"):
        AccumulationStep(model, opt, max_grad_norm=0)
