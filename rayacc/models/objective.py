"""The user's objective (`train.loss: package.module:function`): called per micro-batch as
`function(output, batch)` with the model's output on the batch's input and the batch itself,
it returns (the sum of its loss items, their count). rayacc keeps the rest: the count summed
over micro-steps, ranks and the short last window divides the summed losses once, as for its
own cross-entropy (engine/step.py)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from rayacc.engine.losses import Batch, ItemCounter, model_inputs
from rayacc.models.errors import ModelError

__all__ = [
    "OBJECTIVE_FIX",
    "Objective",
    "check_counts_ahead",
    "check_weighted",
    "is_weighted",
    "weighted_items",
]

OBJECTIVE_FIX = (
    "Fix: train.loss is `package.module:function`, importable on every node, called as "
    "`function(output, batch)` and returning (sum of its loss items as a 0-dim tensor, their "
    "count as an int; a sum of weights where it is declared with "
    "rayacc.models.objective.weighted_items)"
)


def weighted_items(fn: Callable) -> Callable:
    """Declares that `fn`'s count is a sum of weights, a real ≥ 0 (weighted tokens, β-weighted
    pairs): the one rule divides the window's summed losses by the global sum of weights.
    Without it a count must be whole (a count that is not is a mistake, named)."""
    fn.weighted_items = True
    return fn


def is_weighted(fn: Callable) -> bool:
    return getattr(fn, "weighted_items", False) is True


def check_weighted(spec: str, fn: Callable, precision: str, counts_first: str | None) -> None:
    """A weighted count comes with the forward: where the window's count is needed before its
    first backward (`counts_first`: the strategy's reason; fp16's loss scale), it is refused
    before launch (ModelError naming both keys)."""
    if not is_weighted(fn):
        return
    why = counts_first or ("fp16's loss scale" if precision == "fp16" else None)
    if why is None:
        return
    key = "train.precision=fp16" if counts_first is None else "train.strategy"
    raise ModelError(
        f"train.loss={spec!r} counts weighted items (a sum of weights, known only with the "
        f"forward), and {key} needs the window's count before its first backward ({why}). "
        "Fix: train it under ddp or fsdp in fp32 or bf16, or count whole items"
    )


def check_counts_ahead(spec: str, fn: Callable, info, counts_first: str | None) -> None:
    """Where the window's count is needed before its first backward (`counts_first`: why),
    rayacc's counter counts first (the counted target tokens, or the rows) and the function
    must count the same: it is called once on two made-up rows of the data's shape, and one
    that counts otherwise (pairs) is refused before launch, not at the first window. A
    function that cannot take made-up rows is left to the run's own check."""
    from rayacc.engine.losses import IGNORE_INDEX, count_rows, count_target_tokens

    if counts_first is None or is_weighted(fn):
        return
    gen = torch.Generator().manual_seed(0)
    if info.format == "classification":
        batch = {"features": torch.randn(2, info.num_features, generator=gen),
                 "label": torch.zeros(2, dtype=torch.long)}  # fmt: skip
        output, expected = torch.zeros(2, max(info.num_classes, 2)), count_rows(batch)
    else:
        target = torch.tensor([[1, 2, IGNORE_INDEX, IGNORE_INDEX], [1, 2, 3, 1]])
        batch = {"input": target.clamp(min=0), "target": target}
        output, expected = torch.zeros(2, 4, max(info.vocab_size, 4)), count_target_tokens(batch)
    try:
        _, count = checked(spec, fn(output.requires_grad_(), batch))
    except Exception:
        return
    if count != expected:
        what = "rows" if info.format == "classification" else "counted target tokens"
        raise ModelError(
            f"train.loss={spec!r} counted {count} loss items in two rows holding {expected} "
            f"{what}; the run needs the window's count before its first backward "
            f"({counts_first}: train.strategy, train.precision), counted by rayacc as its "
            f"{what}. Fix: count those items, or train under ddp or fsdp in fp32 or bf16, "
            "which take the count the function returns"
        )


class Objective:
    """The user's function as a loss function of rayacc's (engine/losses.py): the forward on
    `input_key`, the function, its return checked. Its count is read on the host: one device
    sync per micro-step on a GPU.

    `ahead`: where the window's count must be known before its first backward (DeepSpeed's
    engine, fp16's loss scale), rayacc's own counter counts the items first (the counted
    target tokens, or the rows) and the function must count the same; its count then adds
    nothing (0), the counter's stands."""

    def __init__(self, spec: str, fn: Callable, input_key: str, ahead: ItemCounter | None = None):
        self.spec, self.fn, self.input_key, self.ahead = spec, fn, input_key, ahead

    def __call__(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, int]:
        output = model(batch[self.input_key], **model_inputs(batch))
        total, count = checked(self.spec, self.fn(output, batch), is_weighted(self.fn))
        if self.ahead is None:
            return total, count
        expected = self.ahead(batch)
        if count != expected:
            what = "the counted target tokens" if self.input_key == "input" else "the rows"
            raise ModelError(
                f"train.loss={self.spec!r} counted {count} loss items where rayacc counted "
                f"{expected} ({what}) before the forward. This strategy or "
                "precision (DeepSpeed's engine, fp16's loss scale) needs the window's count "
                "before its first backward. Fix: count those items, or train under ddp or fsdp "
                "in fp32 or bf16, which take the count the function returns"
            )
        return total, 0


def checked(spec: str, out: object, weighted: bool = False) -> tuple[torch.Tensor, int | float]:
    """(loss sum as a 0-dim tensor, count as an int; a real where `weighted`) from what the
    function returned."""
    if not isinstance(out, tuple | list) or len(out) != 2:
        raise ModelError(
            f"train.loss={spec!r} returned {_kind(out)}, not a pair (sum, count). {OBJECTIVE_FIX}"
        )
    total, count = out
    if not isinstance(total, torch.Tensor) or total.numel() != 1 or not total.is_floating_point():
        raise ModelError(
            f"train.loss={spec!r}: the sum it returned is {_kind(total)}, not a one-number "
            f"floating tensor (the summed loss, with its graph). {OBJECTIVE_FIX}"
        )
    if isinstance(count, torch.Tensor) and count.numel() == 1:
        count = count.item()
    if isinstance(count, float) and count.is_integer():
        count = int(count)
    if weighted and isinstance(count, float) and math.isfinite(count) and count > 0:
        return total.reshape(()), count
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ModelError(
            f"train.loss={spec!r}: the count it returned is {_kind(count)}, not a whole number "
            f"≥ 0 (how many loss items the sum holds). {OBJECTIVE_FIX}"
        )
    return total.reshape(()), count


def _kind(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} ({value.dtype})"
    return f"{value!r}"[:60] if isinstance(value, int | float) else f"a {type(value).__name__}"
