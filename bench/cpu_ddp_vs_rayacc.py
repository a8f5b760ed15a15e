"""rayacc vs bare torch.distributed DDP on 2 CPU workers: same model, data, micro-batch,
accumulation and optimizer kernel (fused AdamW, rayacc's default; `--bare-default-optimizer`
gives the bare loop PyTorch's default per-tensor AdamW instead); and the same bare loop inside
Ray Train workers, which separates what Ray's process environment costs from what rayacc's loop
costs. Prints steady-state samples/s of each,
a per-step breakdown (data wait, gradient sync, handing records over), the ratios, and rayacc's
time to its first optimizer step. On a small shared machine single runs swing by ±10 %: use
--repeats (runs are interleaved) and read the medians.

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
from rayacc.data.bundled import prepare_bundled
from rayacc.data.order import EpochLayout, epoch_order, split_train_val
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


def bare_loop(cfg: TrainConfig, rank: int, world: int, wrap, fused: bool) -> dict[str, list[float]]:
    """A plain DDP loop: no_sync on non-final micro-steps, mean loss / accum, AdamW. Returns
    per-step wall times and the part of each spent slicing the micro-batches (data)."""
    table = pq.read_table(prepare_bundled("digits"))
    x = torch.tensor(
        np.stack(table["features"].to_numpy(zero_copy_only=False)), dtype=torch.float32
    )
    y = torch.tensor(table["label"].to_numpy())
    g, micro = cfg.batch.global_batch_size, cfg.batch.micro_batch_size
    train_ids, _ = split_train_val(len(y), 0.0, cfg.seed)
    layout = EpochLayout(len(train_ids), g, micro, world, "drop")
    torch.manual_seed(cfg.seed)
    model = wrap(MLP(x.shape[1], 10, cfg.model.hidden_sizes))
    o = cfg.optim
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=o.lr,
        betas=o.betas,
        weight_decay=o.weight_decay,
        fused=fused or None,
    )
    times, data = [], []
    for epoch in range(cfg.train.epochs):
        order = epoch_order(train_ids, epoch, cfg.seed, True)
        for s in range(layout.steps_per_epoch):
            t = time.perf_counter()
            parts = layout.rank_window(s, rank).micro_batches
            batches = [(x[idx], y[idx]) for idx in (torch.from_numpy(order[p]) for p in parts)]
            data.append(time.perf_counter() - t)
            opt.zero_grad(set_to_none=True)
            for i, (xb, yb) in enumerate(batches):
                if i < len(parts) - 1:
                    with model.no_sync():
                        (F.cross_entropy(model(xb), yb) / len(parts)).backward()
                else:
                    (F.cross_entropy(model(xb), yb) / len(parts)).backward()
            opt.step()
            times.append(time.perf_counter() - t)
    return {"times": times, "data": data}


def bare_rank(rank: int, world: int, init: str, cfg_json: str, out: str, fused: bool) -> None:
    cfg = TrainConfig.model_validate_json(cfg_json)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    torch.set_num_threads(1)
    res = bare_loop(cfg, rank, world, DDP, fused)
    if rank == 0:
        torch.save(res, out)
    # both ranks done with gloo before either tears it down
    dist.barrier()
    dist.destroy_process_group()


def bare_in_ray_loop(config: dict) -> None:
    """The same bare loop as a Ray Train worker: what Ray's process environment costs."""
    import ray.train
    from ray.train.torch import prepare_model

    cfg = TrainConfig.model_validate_json(config["cfg"])
    ctx = ray.train.get_context()
    torch.set_num_threads(1)
    res = bare_loop(cfg, ctx.get_world_rank(), ctx.get_world_size(), prepare_model, config["fused"])
    if ctx.get_world_rank() == 0:
        torch.save(res, config["out"])
    ray.train.report({"done": 1})


def steady(res: dict[str, list[float]], samples_per_step: int) -> dict[str, float]:
    times, data = res["times"][WARMUP_STEPS:], res["data"][WARMUP_STEPS:]
    return {
        "samples_per_s": samples_per_step * len(times) / sum(times),
        "step_ms": 1e3 * statistics.median(times),
        "p20_ms": 1e3 * statistics.quantiles(times, n=5)[0],
        "data_ms": 1e3 * statistics.median(data),
    }


def run_bare(cfg: TrainConfig, fused: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bare.pt")
        mp.start_processes(
            bare_rank,
            args=(2, os.path.join(tmp, "init"), cfg.model_dump_json(), out, fused),
            nprocs=2,
            join=True,
            start_method="spawn",
        )
        return steady(torch.load(out), cfg.batch.global_batch_size)


def run_bare_in_ray(cfg: TrainConfig, fused: bool) -> dict[str, float]:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from rayacc.driver.fit import ensure_ray

    ensure_ray(cfg.scaling)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bare_ray.pt")
        TorchTrainer(
            bare_in_ray_loop,
            train_loop_config={"cfg": cfg.model_dump_json(), "out": out, "fused": fused},
            scaling_config=ScalingConfig(
                num_workers=2, resources_per_worker={"CPU": cfg.scaling.cpus_per_worker}
            ),
            run_config=RunConfig(storage_path=tmp, name="bare"),
        ).fit()
        res = torch.load(out)
    assert ray.is_initialized()
    return steady(res, cfg.batch.global_batch_size)


def run_rayacc(cfg: TrainConfig) -> dict[str, float]:
    """Steady-state samples/s, the per-step breakdown from the run's own metrics, and the
    time to the first optimizer step."""
    from rayacc.driver.fit import fit
    from rayacc.observe.events import RunObserver

    first: list[float] = []
    t0 = time.perf_counter()

    class FirstStep(RunObserver):
        def on_step(self, record):
            if record["step"] == 1 and not first:
                first.append(time.perf_counter() - t0)

    with tempfile.TemporaryDirectory() as tmp:
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"storage_path": tmp})})
        result = fit(cfg, observers=[FirstStep()])
    rows = [
        r
        for r in result.history
        if r["step"] > WARMUP_STEPS and r["train/samples"] == cfg.batch.global_batch_size
    ]
    walls = [r["train/samples"] / r["train/samples_per_s"] for r in rows]
    data = [r["perf/data_wait_frac"] * w for r, w in zip(rows, walls, strict=True)]
    sync = [r["comm/sync_time_frac"] * (w - d) for r, w, d in zip(rows, walls, data, strict=True)]
    return {
        "samples_per_s": sum(r["train/samples"] for r in rows) / sum(walls),
        "step_ms": 1e3 * statistics.median(walls),
        "p20_ms": 1e3 * statistics.quantiles(walls, n=5)[0],
        "data_ms": 1e3 * statistics.median(data),
        "sync_ms": 1e3 * statistics.median(sync),
        "log_ms": 1e3 * result.summary["log_time_s"] / len(result.history),
        "first_step_s": first[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--bare-default-optimizer",
        action="store_true",
        help="the bare loops use PyTorch's default (per-tensor) AdamW, not the fused kernel",
    )
    args = parser.parse_args()
    cfg = make_config(args)
    fused = not args.bare_default_optimizer
    plan = f"micro {cfg.batch.micro_batch_size}, global {cfg.batch.global_batch_size}, 2 workers"
    print(f"model: MLP 64→{args.hidden}→{args.hidden}→10 on digits; {plan}; {args.epochs} epochs")
    kernel = "fused, as rayacc" if fused else "PyTorch's default per-tensor loop; rayacc: fused"
    print(f"bare loops' AdamW: {kernel}")
    runs: dict[str, list[dict[str, float]]] = {"bare": [], "bare_in_ray": [], "rayacc": []}
    # interleaved, so that slow phases of a shared machine hit all three alike
    for _ in range(args.repeats):
        runs["bare"].append(run_bare(cfg, fused))
        runs["bare_in_ray"].append(run_bare_in_ray(cfg, fused))
        runs["rayacc"].append(run_rayacc(cfg))

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    labels = {
        "bare": "bare DDP (torch.multiprocessing)",
        "bare_in_ray": "the same loop in Ray Train workers",
        "rayacc": "rayacc",
    }
    print(
        f"{'':36} {'samples/s':>10} {'step ms':>8} {'p20 ms':>7} {'data ms':>8} {'sync ms':>8} "
        f"{'log ms':>7}"
    )
    for name, label in labels.items():
        line = f"{label:36} {med(name, 'samples_per_s'):>10,.0f} {med(name, 'step_ms'):>8.2f}"
        line += f" {med(name, 'p20_ms'):>7.2f}"
        line += f" {med(name, 'data_ms'):>8.2f}"
        if name == "rayacc":
            line += f" {med(name, 'sync_ms'):>8.2f} {med(name, 'log_ms'):>7.3f}"
        print(line)
    print(
        "(medians per optimizer step, p20 = 20th percentile; sync = first gradient all-reduce "
        "launch to last completion, overlapping the last backward; log = handing records to "
        "the driver)"
    )
    b = med("bare", "samples_per_s")
    print(f"ratio rayacc / bare DDP: {med('rayacc', 'samples_per_s') / b:.3f}")
    per_repeat = [
        o["samples_per_s"] / r["samples_per_s"]
        for o, r in zip(runs["rayacc"], runs["bare"], strict=True)
    ]
    print(
        "  per repeat (rayacc / the bare run just before it): "
        + ", ".join(f"{x:.3f}" for x in per_repeat)
    )
    p20 = med("bare", "p20_ms") / med("rayacc", "p20_ms")
    print(
        "ratio rayacc / bare DDP on the fastest fifth of the steps (p20 step time, less "
        f"exposed to other load on the machine): {p20:.3f}"
    )
    print(f"ratio bare loop in Ray / bare DDP: {med('bare_in_ray', 'samples_per_s') / b:.3f}")
    print(
        "ratio rayacc / bare loop in Ray: "
        f"{med('rayacc', 'samples_per_s') / med('bare_in_ray', 'samples_per_s'):.3f}"
    )
    print(
        "rayacc time to first optimizer step (fit() call, Ray start included): "
        f"{med('rayacc', 'first_step_s'):.1f} s"
    )


if __name__ == "__main__":
    main()
