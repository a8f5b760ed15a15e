"""The gradient noise scale on gloo ranks: the product's step (`build_rank`) over two windows —
the second's result carries the first's estimate; or the first's settled on its own, and then
the second brings none — against the same estimate made directly in
one process from each small batch's gradient and the window's (float64)."""

from __future__ import annotations

import os

import torch

from tests.support.ranks.engine_helpers import classification_rows, slice_rows

ROWS, GLOBAL, MICRO, LR = 32, 16, 4, 0.1
STRATEGIES = ("ddp", "fsdp every_micro_step", "fsdp window_end", "ddp fp16")
"""A strategy (with FSDP's sync mode), or DDP under fp16: the reduction sees loss-scaled
gradients of the sums times 1 / N, the estimate reads them unscaled."""
TOLERANCE = {"ddp fp16": 2e-2}
"""fp16's forward and backward round to 11 bits: the estimates' relative tolerance (1e-6
where the arithmetic is fp32's)."""


def config(strategy: str):
    from rayacc.config import TrainConfig

    name, _, mode = strategy.partition(" ")
    grad_sync = mode if mode != "fp16" else ""
    return TrainConfig.model_validate(
        {
            "seed": 5,
            "model": {"name": "mlp", "hidden_sizes": [16]},
            "optim": {"name": "sgd", "lr": LR, "momentum": 0.0, "weight_decay": 0.0},
            "batch": {"global_batch_size": GLOBAL, "micro_batch_size": MICRO},
            "scaling": {"num_workers": 2},
            "train": {"strategy": name, "precision": "fp16" if mode == "fp16" else "fp32"},
            **({"fsdp": {"grad_sync": grad_sync}} if grad_sync else {}),
        }
    )


def dataset():
    from tests.support.ranks.uneven import dataset as of

    return of()


def direct(strategy: str) -> tuple[float, float]:
    """(tr Σ, |G|²) of the first window, from the gradients of its small batches — each rank's
    share, or each micro-batch where every micro-step syncs — and of the whole window."""
    import torch.nn.functional as F

    from rayacc.engine.noise import noise_estimates
    from rayacc.models import build_model

    model = build_model(config("ddp"), dataset()).double()
    rows = classification_rows(ROWS, seed=9)
    rows = {k: v.double() if v.is_floating_point() else v for k, v in rows.items()}

    def square(lo: int, hi: int) -> float:
        model.zero_grad()
        part = slice_rows(rows, lo, hi)
        F.cross_entropy(model(part["features"]), part["label"]).backward()
        return float(sum((p.grad.double() ** 2).sum() for p in model.parameters()))

    share = GLOBAL // 2
    size = MICRO if strategy == "fsdp every_micro_step" else share
    units = [(lo, lo + size) for lo in range(0, GLOBAL, size)]
    sums = [sum(square(*u) for u in units), sum(1 / (hi - lo) for lo, hi in units), len(units)]
    return noise_estimates(sums, square(0, GLOBAL), GLOBAL)


def run_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from rayacc.config.batch_split import BatchSplit
    from rayacc.engine import classification_item_losses
    from rayacc.rank.build import build_rank

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    out: dict = {}
    try:
        rows = classification_rows(ROWS, seed=9)
        share = GLOBAL // world
        for strategy in STRATEGIES:
            split = BatchSplit(GLOBAL, MICRO, share // MICRO, world)
            parts = build_rank(config(strategy), dataset(), torch.device("cpu"), LR, split=split)
            noise = []
            for w in range(ROWS // GLOBAL):
                lo = w * GLOBAL + rank * share
                mbs = [slice_rows(rows, a, a + MICRO) for a in range(lo, lo + share, MICRO)]
                noise.append(parts.accumulate(mbs, classification_item_losses).noise)
            out[strategy] = noise
            parts = build_rank(config(strategy), dataset(), torch.device("cpu"), LR, split=split)
            mbs = [
                slice_rows(rows, a, a + MICRO)
                for a in range(rank * share, (rank + 1) * share, MICRO)
            ]
            parts.accumulate(mbs, classification_item_losses)
            settled = parts.accumulate.settle_noise()
            after = parts.accumulate(mbs, classification_item_losses).noise
            out[strategy + " settled"] = (settled, after, parts.accumulate.settle_noise())
    except Exception as exc:  # the test reads it: a rank's error, not a hang
        import traceback

        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
    torch.save(out, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()
