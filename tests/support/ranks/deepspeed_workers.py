"""Rank bodies for the DeepSpeed tests (2 gloo processes, no Ray): rayacc's accumulation step
over DeepSpeed's engine at each ZeRO stage, with and without optimizer offload, over a full
window and a short last one, built as a worker builds it (`build_rank`)."""

from __future__ import annotations

import os

import torch

from tests.support.ranks.engine_helpers import (
    classification_rows,
    hf_weights_first_step,
    micro_batches,
    slice_rows,
)

CASES = (
    (1, "none"),
    (1, "cpu"),
    (2, "none"),
    (3, "none"),
    (2, "cpu"),
    (3, "cpu"),
)
"""(ZeRO stage, optimizer offload)."""
BF16_CASES = ((1, "none"), (2, "cpu"), (3, "none"))
"""The same under train.precision=bf16 (DeepSpeed's bf16: the module in bf16, fp32 master
weights in the optimizer)."""
LR = 0.5
WINDOWS = ((0, 24, 6), (24, 28, 2))
"""(first row, end row, micro-batch per rank) of each window: a full one of 2 micro-steps per
rank, then a short last one."""


def config(
    stage: int, offload: str, max_grad_norm=None, optimizer: str = "sgd", precision: str = "fp32"
):
    from rayacc.config import TrainConfig

    return TrainConfig.model_validate(
        {
            "seed": 5,
            "model": {"name": "mlp", "hidden_sizes": [16]},
            "optim": {
                "name": optimizer,
                "lr": LR,
                "momentum": 0.0,
                "weight_decay": 0.0,
                "max_grad_norm": max_grad_norm,
            },
            "batch": {"global_batch_size": 24, "micro_batch_size": 6},
            "scaling": {"num_workers": 2},
            "train": {"strategy": "deepspeed", "precision": precision},
            "deepspeed": {"stage": stage, "offload_optimizer": offload},
        }
    )


def dataset():
    from rayacc.data.sources import DatasetInfo
    from tests.support.ranks.engine_helpers import N_CLASSES, N_FEATURES

    return DatasetInfo(
        path="rows.parquet",
        format="classification",
        num_rows=28,
        num_features=N_FEATURES,
        num_classes=N_CLASSES,
    )


def whole(strategy) -> torch.Tensor:
    """Every parameter, gathered whole (ZeRO-3 holds shards), as one float64 vector."""
    import deepspeed

    module = strategy.unwrapped()
    params = list(module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return torch.cat([p.detach().reshape(-1).double().clone() for p in params])


class Payload:
    """A pickle that runs a command when it is unpickled."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def resume_planted(parts, out_dir: str, rank: int) -> str:
    """The last case's checkpoint with rank 1's optimizer file replaced by a pickle that runs a
    command, resumed by every rank: what the load raised (the test also checks the command
    never ran)."""
    import shutil

    import torch.distributed as dist

    stage, offload = CASES[-1]
    planted = f"{out_dir}/planted"
    if rank == 0:
        shutil.copytree(f"{out_dir}/zero{stage}-{offload}", planted)
        torch.save(
            {"optimizer_state_dict": Payload(f"{out_dir}/payload-ran")},
            f"{planted}/zero/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        )
    dist.barrier()
    try:
        parts.strategy.state.load(parts.model, parts.optimizer, planted, {}, 2)
    except ValueError as exc:
        return str(exc)
    return "loaded"


def adamw_windows(rank: int, world: int, rows, out_dir: str, resume: bool = False):
    """ZeRO-3 under AdamW: the first window, a checkpoint, the second window; or (`resume`)
    the checkpoint another number of ranks wrote, then the second window. The weights after."""
    from rayacc.config.batch_split import BatchSplit
    from rayacc.engine import classification_item_losses
    from rayacc.rank.build import build_rank

    cfg = config(3, "none", optimizer="adamw")
    parts = build_rank(
        cfg, dataset(), torch.device("cpu"), LR / 50, split=BatchSplit(24, 6, 4 // world, world)
    )
    windows = WINDOWS[1:] if resume else WINDOWS
    if resume:
        parts.strategy.state.load(parts.model, parts.optimizer, f"{out_dir}/adamw", {}, 2)
    for i, (lo, hi, micro) in enumerate(windows):
        per = (hi - lo) // world
        mine = slice_rows(rows, lo + rank * per, lo + (rank + 1) * per)
        parts.accumulate(micro_batches(mine, micro), classification_item_losses)
        if i == 0 and not resume:
            parts.strategy.state.save(parts.model, parts.optimizer, f"{out_dir}/adamw", rank)
    return whole(parts.strategy)


def resize_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """A rank of `world` resuming the 2 ranks' AdamW checkpoint."""
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    out: dict = {}
    try:
        out["adamw"] = adamw_windows(rank, world, classification_rows(28, seed=9), out_dir, True)
    except Exception as exc:  # the test reads it: a rank's error, not a hang
        import traceback

        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
    torch.save(out, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def run_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from rayacc.config.batch_split import BatchSplit
    from rayacc.engine import classification_item_losses
    from rayacc.engine.autobatch import measure_step_bytes
    from rayacc.rank.build import build_rank

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    rows = classification_rows(28, seed=9)
    out: dict = {}
    try:
        cases = [(s, o, "fp32") for s, o in CASES] + [(s, o, "bf16") for s, o in BF16_CASES]
        for stage, offload, precision in cases:
            parts = build_rank(
                config(stage, offload, precision=precision),
                dataset(),
                torch.device("cpu"),
                LR,
                split=BatchSplit(24, 6, 2, world),
            )
            before = whole(parts.strategy)
            # the planner's memory probe first (a forward and backward through the engine,
            # then its gradients discarded): it must leave no trace on the steps after it.
            # Not under ZeRO-2, whose reduced gradients outlive the discard (docs/design.md)
            if stage != 2:
                measure_step_bytes(
                    parts.strategy.unwrapped(),
                    classification_item_losses,
                    slice_rows(rows, rank * 6, (rank + 1) * 6),
                    autocast_dtype=torch.bfloat16 if precision == "bf16" else None,
                    strategy=parts.strategy,
                )
            steps, comm = [], []
            for lo, hi, micro in WINDOWS:
                per = (hi - lo) // world
                mine = slice_rows(rows, lo + rank * per, lo + (rank + 1) * per)
                result = parts.accumulate(micro_batches(mine, micro), classification_item_losses)
                steps.append((result.items, result.skipped, result.micro_steps))
                comm.append(
                    (
                        result.allreduce_calls,
                        result.reduce_scatter_calls,
                        result.all_gather_calls,
                        result.sync_passes,
                    )
                )
            # DeepSpeed's own files, every rank its part, as a checkpoint holds them
            name = f"zero{stage}-{offload}" + ("" if precision == "fp32" else f"-{precision}")
            parts.strategy.state.save(parts.model, parts.optimizer, f"{out_dir}/{name}", rank)
            if precision != "fp32":
                out[(stage, offload, precision)] = {"steps": steps, "comm": comm}
                continue
            out[(stage, offload)] = {
                "before": before,
                "after": whole(parts.strategy),
                "steps": steps,
                "comm": comm,
                "lockstep": parts.strategy.contract.lockstep,
            }
        from tests.support.ranks import uneven

        for stage in (2, 3):  # 25 rows a window over 2 ranks: 13 + 12
            out[("uneven", stage)] = uneven.train(
                uneven.config("deepspeed", world, deepspeed_stage=stage), rank, world, whole
            )
        out["planted"] = resume_planted(parts, out_dir, rank)
        out["adamw"] = adamw_windows(rank, world, rows, out_dir)
        out["hf_weights"] = hf_weights_first_step(hf_config(3), hf_parts(world), rank, world)
    except Exception as exc:  # the test reads it: a rank's error, not a hang
        import traceback

        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
    torch.save(out, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def no_compiler_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """A rank on a machine where DeepSpeed's op has not been built and no C++ compiler runs:
    what building the strategy raised."""
    import torch.distributed as dist

    from rayacc.config.batch_split import BatchSplit
    from rayacc.rank.build import build_rank

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        CXX="/nonexistent/c++",
        TORCH_EXTENSIONS_DIR=f"{out_dir}/torch_extensions",
    )
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    out: dict = {}
    try:
        build_rank(
            config(2, "none"), dataset(), torch.device("cpu"), LR, split=BatchSplit(24, 6, 4, 1)
        )
        out["raised"] = None
    except Exception as exc:
        out["raised"] = f"{type(exc).__name__}: {exc}"
    torch.save(out, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


def hf_config(stage: int):
    """The job of `config(stage, ...)` with a model section given."""

    def of(model: dict):
        from rayacc.config import TrainConfig

        base = config(stage, "none").model_dump(mode="json", exclude_unset=True)
        return TrainConfig.model_validate({**base, "model": model, "batch": {
            "global_batch_size": 16, "micro_batch_size": 4}})  # fmt: skip

    return of


def hf_parts(world: int):
    def build(cfg):
        from rayacc.config.batch_split import BatchSplit
        from rayacc.data.sources import DatasetInfo
        from rayacc.rank.build import build_rank
        from tests.support.ranks.engine_helpers import VOCAB

        info = DatasetInfo("tokens.parquet", "tokens", 64, vocab_size=VOCAB, max_tokens=13)
        parts = build_rank(cfg, info, torch.device("cpu"), LR, split=BatchSplit(16, 4, 2, world))
        return parts.accumulate, parts.loss_fn, parts.count

    return build
