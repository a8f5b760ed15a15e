"""A strategy's promises to the accumulation step are one frozen value (`Contract`), declared in
one place per strategy and read once when the step is built: the step asks no flag per window."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rayacc.engine import AccumulationStep, classification_item_losses
from rayacc.engine.parallel import DDP, FSDP, Contract, DeepSpeed, strategy_classes
from tests.support.ranks.engine_helpers import TinyClassifier, classification_rows, micro_batches


def _deepspeed(stage: int) -> DeepSpeed:
    return DeepSpeed({"zero_optimization": {"stage": stage}})


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        (DDP(), Contract()),
        (
            FSDP("every_micro_step"),
            Contract(lockstep=True, retries_out_of_memory=False, fused_sgd=False,
                     gathers_in_forward=True),
        ),
        (
            FSDP("window_end"),
            Contract(lockstep=True, retries_out_of_memory=False, fused_sgd=False,
                     gathers_in_forward=True, holds_whole_gradients=True),
        ),
        *[
            (
                _deepspeed(stage),
                Contract(window_rule="count_first", steps="engine", lockstep=stage == 3,
                         retries_out_of_memory=False, fused_sgd=False,
                         gathers_in_forward=stage == 3, holds_whole_gradients=stage < 2),
            )
            for stage in (1, 2, 3)
        ],
    ],
    ids=["ddp", "fsdp", "fsdp-window_end", "zero1", "zero2", "zero3"],
)  # fmt: skip
def test_each_strategy_declares_its_contract(strategy, expected):
    assert strategy.contract == expected
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.contract.lockstep = not strategy.contract.lockstep  # type: ignore[misc]


def test_every_registered_strategy_has_a_contract():
    assert all(isinstance(cls.contract, Contract) for cls in strategy_classes().values())


class _Asked:
    def __getattr__(self, name):
        raise AssertionError(f"the step asked the contract's {name} during a window")


def test_the_step_reads_the_contract_once_when_it_is_built():
    model = TinyClassifier()
    step = AccumulationStep(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy=DDP())
    step.strategy.contract = _Asked()  # type: ignore[assignment]
    result = step(micro_batches(classification_rows(12), 4), classification_item_losses)
    assert result.micro_steps == 3 and result.items == 12
