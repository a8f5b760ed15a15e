"""Uneven shares of a window (a worker count that does not divide the global batch) on gloo
ranks: the product's split and layout (`run.quantities.split_at`, `epoch_layout`) cut each
rank's rows and micro-batches, the product's step (`build_rank`) runs them, and the update is
compared with single-process full-batch steps over the same windows."""

from __future__ import annotations

import os

import torch

from tests.support.ranks.engine_helpers import (
    classification_rows,
    full_batch_classification_loss,
    full_weights,
    reference_sgd_step,
    slice_rows,
)

ROWS, LR = 28, 0.5
GLOBAL = {3: 11, 2: 25}
"""The global batch at each rank count: 11 over 3 ranks is 4 + 4 + 3 (then a short window of
6); 25 over 2 is 13 + 12 (then a short window of 3)."""
MICRO = {3: 2, 2: 6}
STRATEGIES = ("ddp", "fsdp every_micro_step", "fsdp window_end")
"""Those of the 3-rank body; ZeRO rides the DeepSpeed tests' 2 ranks (`deepspeed_case`)."""


def config(strategy: str, world: int, deepspeed_stage: int | None = None):
    """A job of `world` workers whose count does not divide the global batch (an elastic one
    at that size splits alike: tests/unit/config/test_batch_split.py)."""
    from rayacc.config import TrainConfig

    name, _, grad_sync = strategy.partition(" ")
    return TrainConfig.model_validate(
        {
            "seed": 5,
            "model": {"name": "mlp", "hidden_sizes": [16]},
            "optim": {"name": "sgd", "lr": LR, "momentum": 0.0, "weight_decay": 0.0},
            "batch": {"global_batch_size": GLOBAL[world], "micro_batch_size": MICRO[world]},
            "scaling": {"num_workers": world},
            "train": {"strategy": name},
            **({"fsdp": {"grad_sync": grad_sync}} if grad_sync else {}),
            **({"deepspeed": {"stage": deepspeed_stage}} if deepspeed_stage else {}),
        }
    )


def dataset():
    from rayacc.data.sources import DatasetInfo
    from tests.support.ranks.engine_helpers import N_CLASSES, N_FEATURES

    return DatasetInfo(
        path="rows.parquet",
        format="classification",
        num_rows=ROWS,
        num_features=N_FEATURES,
        num_classes=N_CLASSES,
    )


def train(cfg, rank: int, world: int, whole=None) -> dict:
    """This rank's windows of an epoch through the product's step: the whole weights before
    and after (`whole(strategy)`, a collective where sharded), and what each step ran (items,
    micro-steps, this rank's rows per micro-batch)."""
    from rayacc.engine import classification_item_losses
    from rayacc.rank.build import build_rank
    from rayacc.run.quantities import RunLength, epoch_layout, split_at

    split = split_at(cfg, world)
    layout = epoch_layout(RunLength.of(cfg), ROWS, split)
    parts = build_rank(cfg, dataset(), torch.device("cpu"), LR, split=split)
    rows = classification_rows(ROWS, seed=9)
    whole = whole or (lambda strategy: full_weights(strategy.unwrapped()))
    before = whole(parts.strategy)
    steps = []
    for s in range(layout.steps_per_epoch):
        cut = layout.rank_window(s, rank).micro_batches
        mbs = [slice_rows(rows, int(p[0]), int(p[-1]) + 1) for p in cut]
        result = parts.accumulate(mbs, classification_item_losses)
        steps.append((result.items, result.micro_steps, [len(p) for p in cut]))
    after = whole(parts.strategy)
    return {"shares": split.rank_shares, "steps": steps, "before": before, "after": after}


def reference(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-batch SGD steps on the same windows (G rows each, the rest last) in one process."""
    from rayacc.models import build_model

    model = build_model(config("ddp", world), dataset())
    before = torch.cat([p.detach().reshape(-1).double().clone() for p in model.parameters()])
    rows = classification_rows(ROWS, seed=9)
    g = GLOBAL[world]
    for lo in range(0, ROWS, g):
        loss = full_batch_classification_loss(model, slice_rows(rows, lo, min(lo + g, ROWS)))
        reference_sgd_step(model, loss, LR)
    return before, torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def run_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Every strategy of `STRATEGIES` in one gloo group of `world` ranks."""
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    out: dict = {}
    try:
        for strategy in STRATEGIES:
            out[strategy] = train(config(strategy, world), rank, world)
    except Exception as exc:  # the test reads it: a rank's error, not a hang
        import traceback

        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
    torch.save(out, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()
