"""rayacc vs bare torch.distributed DDP on 2 CPU workers: same model, data, micro-batch and
accumulation. Prints steady-state samples/s of each, their ratio, and rayacc's time to its
first optimizer step.

    .venv/bin/python bench/cpu_ddp_vs_rayacc.py [--epochs 20] [--hidden 256]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rayacc import TrainConfig
from rayacc.data.order import EpochLayout, epoch_order, split_train_val
from rayacc.data.sources import prepare_bundled
from rayacc.models.mlp import MLP

WARMUP_STEPS = 5


def make_config(args) -> TrainConfig:
    return TrainConfig.from_yaml(
        Path(__file__).resolve().parent.parent / "jobs" / "digits.yaml",
        overrides=[
            f"train.epochs={args.epochs}",
            f"model.hidden_sizes=[{args.hidden}, {args.hidden}]",
            "train.val_every_steps=null",
            "train.checkpoint_every_steps=null",
            "data.val_fraction=0",
            "tracking.enabled=false",
        ],
    )


def bare_rank(rank: int, world: int, init: str, cfg_json: str, out: str) -> None:
    """A plain DDP loop: no_sync on non-final micro-steps, mean loss / accum, AdamW."""
    cfg = TrainConfig.model_validate_json(cfg_json)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    torch.set_num_threads(1)
    table = pq.read_table(prepare_bundled("digits"))
    x = torch.tensor(
        np.stack(table["features"].to_numpy(zero_copy_only=False)), dtype=torch.float32
    )
    y = torch.tensor(table["label"].to_numpy())
    g, micro = cfg.batch.global_batch_size, cfg.batch.micro_batch_size
    train_ids, _ = split_train_val(len(y), 0.0, cfg.seed)
    layout = EpochLayout(len(train_ids), g, micro, world, "drop")
    torch.manual_seed(cfg.seed)
    model = DDP(MLP(x.shape[1], 10, cfg.model.hidden_sizes))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    times = []
    for epoch in range(cfg.train.epochs):
        order = epoch_order(train_ids, epoch, cfg.seed, True)
        for s in range(layout.steps_per_epoch):
            t = time.perf_counter()
            parts = layout.rank_window(s, rank).micro_batches
            opt.zero_grad(set_to_none=True)
            for i, pos in enumerate(parts):
                idx = torch.from_numpy(order[pos])
                if i < len(parts) - 1:
                    with model.no_sync():
                        (F.cross_entropy(model(x[idx]), y[idx]) / len(parts)).backward()
                else:
                    (F.cross_entropy(model(x[idx]), y[idx]) / len(parts)).backward()
            opt.step()
            times.append(time.perf_counter() - t)
    if rank == 0:
        torch.save({"times": times, "samples_per_step": g}, out)
    dist.destroy_process_group()


def run_bare(cfg: TrainConfig) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bare.pt")
        mp.start_processes(
            bare_rank,
            args=(2, os.path.join(tmp, "init"), cfg.model_dump_json(), out),
            nprocs=2,
            join=True,
            start_method="spawn",
        )
        res = torch.load(out)
    steady = res["times"][WARMUP_STEPS:]
    return res["samples_per_step"] * len(steady) / sum(steady)


def run_rayacc(cfg: TrainConfig) -> tuple[float, float, float]:
    """(steady-state samples/s, seconds to the first step, share of step time spent logging)"""
    from rayacc.runner.driver import fit

    first: list[float] = []
    t0 = time.perf_counter()

    def on_record(rec):
        if rec.get("step") == 1 and "event" not in rec and not first:
            first.append(time.perf_counter() - t0)

    with tempfile.TemporaryDirectory() as tmp:
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"storage_path": tmp})})
        result = fit(cfg, on_record=on_record)
    steady = [
        r
        for r in result.history
        if r["step"] > WARMUP_STEPS and r["train/samples"] == cfg.batch.global_batch_size
    ]
    seconds = sum(r["train/samples"] / r["train/samples_per_s"] for r in steady)
    log_share = result.summary["log_time_s"] / result.summary["train_time_s"]
    return sum(r["train/samples"] for r in steady) / seconds, first[0], log_share


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    cfg = make_config(args)
    plan = f"micro {cfg.batch.micro_batch_size}, global {cfg.batch.global_batch_size}, 2 workers"
    print(f"model: MLP 64→{args.hidden}→{args.hidden}→10 on digits; {plan}; {args.epochs} epochs")
    bare, ours, first, log_share = [], [], [], []
    for _ in range(args.repeats):
        bare.append(run_bare(cfg))
        sps, t_first, share = run_rayacc(cfg)
        ours.append(sps)
        first.append(t_first)
        log_share.append(share)
    b, o = statistics.median(bare), statistics.median(ours)
    print(f"bare DDP   steady-state samples/s: {b:,.0f}")
    print(f"rayacc     steady-state samples/s: {o:,.0f}")
    print(f"ratio rayacc / bare: {o / b:.3f}")
    print(
        f"rayacc     share of step time spent handing records to the driver: "
        f"{statistics.median(log_share):.2%}"
    )
    t_first = statistics.median(first)
    print(f"rayacc time to first optimizer step (fit() call, Ray start included): {t_first:.1f} s")


if __name__ == "__main__":
    main()
