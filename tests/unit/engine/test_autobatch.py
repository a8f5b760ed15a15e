"""`batch.micro_batch_size: auto`: the search logic against a memory budget, on CPU."""

from __future__ import annotations

import pytest
import torch

from rayacc.engine import classification_item_losses
from rayacc.engine.autobatch import (
    candidate_micro_sizes,
    find_micro_batch_size,
    largest_fitting,
    measure_step_bytes,
)
from tests.support.ranks.engine_helpers import slice_rows


def test_candidates_divide_the_share_so_the_global_batch_is_kept():
    assert candidate_micro_sizes(48) == [48, 24, 16, 12, 8, 6, 4, 3, 2, 1]
    assert candidate_micro_sizes(48, upper=10) == [8, 6, 4, 3, 2, 1]
    assert all(96 % m == 0 for m in candidate_micro_sizes(96))
    with pytest.raises(ValueError):
        candidate_micro_sizes(0)


@pytest.mark.parametrize("limit", [1, 2, 5, 7, 12, 47, 48, 100])
def test_binary_search_finds_the_largest_fitting_divisor(limit):
    calls = []

    def fits(size):
        calls.append(size)
        return size <= limit

    best, trials = largest_fitting(candidate_micro_sizes(48), fits)
    assert best == max(d for d in candidate_micro_sizes(48) if d <= limit)
    assert len(calls) <= 4, "log2(10 candidates) trials, not one per candidate"
    assert trials == [(s, s <= limit) for s in calls]


def test_nothing_fits_names_the_budget_fields():
    with pytest.raises(ValueError, match="memory_budget"):
        largest_fitting([4, 2, 1], lambda size: False)


def _model_and_batches(width=256):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 4)
    )
    rows = {
        "features": torch.randn(64, 8),
        "label": torch.randint(0, 4, (64,)),
    }

    def make_batch(n):
        return slice_rows(rows, 0, n)

    return model, make_batch


def test_cpu_estimate_grows_with_the_micro_batch_and_counts_parameters():
    model, make_batch = _model_and_batches()
    params = sum(p.numel() * 4 for p in model.parameters())
    sizes = [1, 8, 32, 64]
    used = [measure_step_bytes(model, classification_item_losses, make_batch(n)) for n in sizes]
    assert used == sorted(used) and used[0] < used[-1]
    # parameters + gradients + AdamW's two buffers, then activations on top
    assert used[0] > 4 * params
    # activations: ReLU's output (which the second Linear saves too: one storage, counted
    # once) and the 8 input features, per sample
    per_sample = (used[-1] - used[0]) / (64 - 1)
    assert per_sample == pytest.approx((256 + 8) * 4, rel=0.05), per_sample
    # the weights each Linear saves for backward are the parameters: not counted twice
    # (the planner compares this figure with its prediction)
    assert used[0] - 4 * params < params / 2, (used[0] - 4 * params, params)
    assert all(p.grad is None for p in model.parameters()), "the probe leaves no gradients"


def test_search_with_a_budget_picks_the_largest_divisor_within_it():
    model, make_batch = _model_and_batches()
    share = 48
    used = {
        m: measure_step_bytes(model, classification_item_losses, make_batch(m))
        for m in candidate_micro_sizes(share)
    }
    budget = (used[12] + used[16]) // 2  # 12 fits, 16 does not
    search = find_micro_batch_size(
        model,
        classification_item_losses,
        make_batch,
        samples_per_worker=share,
        budget_bytes=budget,
    )
    assert (search.micro_batch_size, search.grad_accum_steps) == (12, 4)
    assert search.micro_batch_size * search.grad_accum_steps == share
    with pytest.raises(ValueError, match="not even a micro-batch of 1"):
        find_micro_batch_size(
            model,
            classification_item_losses,
            make_batch,
            samples_per_worker=share,
            budget_bytes=used[1] - 1,
        )


def test_out_of_memory_counts_as_too_large_and_other_errors_propagate():
    model, make_batch = _model_and_batches()

    def oom_above_8(m, batch):
        if batch["features"].shape[0] > 8:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return classification_item_losses(m, batch)

    search = find_micro_batch_size(
        model, oom_above_8, make_batch, samples_per_worker=48, budget_bytes=1 << 40
    )
    assert search.micro_batch_size == 8

    def broken(m, batch):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes"):
        measure_step_bytes(model, broken, make_batch(4))


def test_the_probe_counts_what_autograd_holds_at_once_not_all_it_ever_saved():
    """A pipeline's schedule frees a micro-batch's saved activations after its backward, as
    the next ones' are saved: the probe counts the most held at once (one micro-step holds
    all it saves until its backward: the sum)."""
    import torch

    from rayacc.engine.autobatch import _SavedBytes

    layer = torch.nn.Linear(64, 64)
    saved = _SavedBytes({p.untyped_storage().data_ptr() for p in layer.parameters()})
    hooks = torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t)

    def forward():
        with hooks:
            return torch.tanh(layer(torch.randn(32, 64))).sum()

    loss = forward()
    one = saved.now
    assert one >= 2 * 32 * 64 * 4  # the layer's input and the tanh's output
    loss.backward()
    del loss
    assert saved.now == 0, "a backward frees what its forward saved"
    held = [forward(), forward()]  # two micro-batches in flight
    assert saved.peak == saved.now == 2 * one
    for loss in held:
        loss.backward()
    del held, loss
    forward().backward()  # one more after them: the peak stays that of the two
    assert saved.peak == 2 * one
