"""A weighted objective (`weighted_items`): its count, a sum of weights, is a real ≥ 0 the one
rule divides by (gloo ranks: tests/distributed/test_finetune_matrix.py); an undeclared
objective's count must be whole; where the window's count is needed before the first backward
(DeepSpeed's engine, fp16's loss scale) a weighted objective is refused before launch, named."""

from __future__ import annotations

import math

import pytest
import torch

from rayacc.cli import main
from rayacc.models import ModelError
from rayacc.models.objective import checked, is_weighted

SUM = torch.tensor(2.5, requires_grad=True)


@pytest.mark.parametrize("count", [264.83, torch.tensor(0.5), 3, 3.0])
def test_a_weighted_count_is_a_positive_real(count):
    total, n = checked("m:f", (SUM, count), weighted=True)
    assert total.shape == () and math.isclose(n, float(count))


@pytest.mark.parametrize("count", [264.83, torch.tensor(0.5)])
def test_an_undeclared_real_count_is_named_as_a_mistake(count):
    with pytest.raises(ModelError, match="not a whole number.*weighted_items"):
        checked("m:f", (SUM, count))


@pytest.mark.parametrize("count", [-1.5, float("nan"), float("inf"), True])
def test_a_weighted_count_is_still_checked(count):
    with pytest.raises(ModelError, match="the count it returned"):
        checked("m:f", (SUM, count), weighted=True)


def test_the_shipped_weighted_objective_declares_itself():
    from jobs.objectives import label_smoothed, sqrt_row_weighted

    assert is_weighted(sqrt_row_weighted) and not is_weighted(label_smoothed)
    output = torch.randn(2, 5, 7)
    target = torch.tensor([[1, 2, -100, -100, -100], [3, 4, 5, 6, -100]])
    total, count = sqrt_row_weighted(output, {"target": target})
    assert math.isclose(count, math.sqrt(2) + math.sqrt(4), rel_tol=1e-6)  # n/√n a row
    ce = torch.nn.functional.cross_entropy(output.transpose(1, 2), target.clamp(min=0),
                                           reduction="none")  # fmt: skip
    expected = ce[0, :2].sum() / math.sqrt(2) + ce[1, :4].sum() / 2
    assert torch.allclose(total, expected)


@pytest.mark.parametrize(
    "settings, named",
    [
        (["train.strategy=deepspeed"], "train.strategy needs the window's count"),
        (["train.precision=fp16", "scaling.use_gpu=true"], "train.precision=fp16 needs"),
    ],
)
def test_a_weighted_objective_that_needs_the_count_first_is_refused_before_launch(
    settings, named, capsys
):
    job = ["-c", "jobs/digits.yaml", "train.loss=jobs.objectives:sqrt_row_weighted", *settings]
    assert main(["plan", *job]) == 2
    err = capsys.readouterr().err
    assert "train.loss='jobs.objectives:sqrt_row_weighted' counts weighted items" in err, err
    assert named in err and "Fix:" in err and "Traceback" not in err, err
    # the same job under DDP in fp32 plans
    assert main(["plan", "-c", "jobs/digits.yaml",
                 "train.loss=jobs.objectives:sqrt_row_weighted"]) == 0  # fmt: skip


def test_an_objective_counting_other_items_under_an_engine_that_counts_first_is_refused_early():
    """`jobs.objectives:pair_margin` counts pairs; DeepSpeed counts the target tokens before
    the first backward: refused before launch (it failed at the first window, after the
    workers started); the token-counting objective passes."""
    from jobs.objectives import label_smoothed, pair_margin
    from rayacc import TrainConfig
    from rayacc.data.sources import DatasetInfo
    from rayacc.models.objective import check_counts_ahead

    info = DatasetInfo(path="t.parquet", format="tokens", num_rows=8, vocab_size=16, max_tokens=9)
    why = "DeepSpeed's engine scales each backward itself"
    with pytest.raises(ModelError) as refused:
        check_counts_ahead("jobs.objectives:pair_margin", pair_margin, info, why)
    text = str(refused.value)
    assert "counted 1 loss items in two rows holding 6 counted target tokens" in text, text
    assert why in text and "train.strategy" in text and "Fix:" in text, text
    check_counts_ahead("jobs.objectives:label_smoothed", label_smoothed, info, why)
    check_counts_ahead("jobs.objectives:pair_margin", pair_margin, info, None)  # counts after
    # through the launch's own check
    from rayacc.driver.prelaunch import prepare

    cfg = TrainConfig.from_dict({
        "data": {"source": "shakespeare", "seq_len": 16, "val_fraction": 0.0},
        "model": {"name": "gpt", "n_layer": 1, "n_head": 1, "n_embd": 8, "block_size": 16},
        "batch": {"global_batch_size": 4, "micro_batch_size": 2},
        "train": {"strategy": "deepspeed", "loss": "jobs.objectives:pair_margin",
                  "loss_chunk_tokens": None},
        "scaling": {"num_workers": 2}, "tracking": {"enabled": False},
    })  # fmt: skip
    with pytest.raises(ModelError, match="counted 1 loss items"):
        prepare(cfg)
