"""The accumulation step alone against a bare DDP loop, in 2 plain gloo processes (no Ray): the
same MLP, micro-batches and fused AdamW; the bare loop does no_sync on non-final micro-steps and
mean loss / accum, the engine its item-count normalisation, window statistics, gradient norm
and accounting.

Both run in the same two processes, alternating in blocks of a few steps, so that whatever
else the machine does hits both alike (separate runs on a small shared machine differ by
±20 %). Prints each one's mean, median and 20th-percentile step time and the ratios.

`--in-ray` runs the same two processes as Ray Train workers (a local Ray cluster): what Ray's
process environment does to each.

    .venv/bin/python bench/cpu_engine_vs_bare.py [--blocks 100] [--block-steps 10] [--in-ray]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rayacc.engine import AccumulationStep, classification_item_losses
from rayacc.models.mlp import MLP

MICRO, ACCUM = 32, 4
VARIANTS = ("bare", "engine")


def make_runner(variant: str):
    torch.manual_seed(0)
    model = DDP(MLP(64, 10, [256, 256]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    if variant == "engine":
        step = AccumulationStep(model, opt)
        return lambda mbs: step(mbs, classification_item_losses)

    def bare(mbs):
        opt.zero_grad(set_to_none=True)
        for i, mb in enumerate(mbs):
            # no_sync around forward and backward: DDP arms the all-reduce in forward
            sync = contextlib.nullcontext() if i == len(mbs) - 1 else model.no_sync()
            with sync:
                (F.cross_entropy(model(mb["features"]), mb["label"]) / len(mbs)).backward()
        opt.step()

    return bare


def engine_and_bare(rank: int) -> dict:
    """This script's two variants (the same on every rank)."""
    return {v: make_runner(v) for v in VARIANTS}


Times = dict[str, dict[str, list[float]]]
"""Per variant, per clock (`wall`; `cpu`: the process's CPU time, every thread), one time a
step."""


def alternate(make_runners, rank: int, blocks: int, block_steps: int, flip: bool = False) -> Times:
    """The runners `make_runners(rank)` builds, on this rank's process group, in alternating
    blocks of steps on the same micro-batches; per-step times. `flip`: each variant goes first
    in every other block, so neither always follows the other."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = torch.randn(4096, 64), torch.randint(0, 10, (4096,))
    runners = make_runners(rank)
    names = list(runners)
    times: Times = {v: {"wall": [], "cpu": []} for v in names}
    s = 0
    for b in range(blocks):
        for variant in names[::-1] if flip and b % 2 == 0 else names:
            for _ in range(block_steps):
                start = (s * MICRO * ACCUM) % (4096 - MICRO * ACCUM)
                s += 1
                mbs = [
                    {"features": x[i : i + MICRO], "label": y[i : i + MICRO]}
                    for i in range(start, start + MICRO * ACCUM, MICRO)
                ]
                c, t = time.process_time(), time.perf_counter()
                runners[variant](mbs)
                times[variant]["wall"].append(time.perf_counter() - t)
                times[variant]["cpu"].append(time.process_time() - c)
    # the first two blocks warm up allocator and caches
    return {v: {k: t[2 * block_steps :] for k, t in clocks.items()} for v, clocks in times.items()}


def rank_body(rank: int, init: str, args: tuple, queue) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )
    times = alternate(args[0], rank, *args[1:])
    if rank == 0:
        queue.put(times)
    dist.barrier()
    dist.destroy_process_group()


def in_gloo_ranks(make_runners, blocks: int, block_steps: int, flip: bool = False) -> Times:
    """`alternate` in 2 spawned gloo processes; rank 0's times. `make_runners` must be
    picklable (a module-level function, or a partial of one)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        args = (make_runners, blocks, block_steps, flip)
        procs = [
            ctx.Process(target=rank_body, args=(r, f"{tmp}/init", args, queue)) for r in range(2)
        ]
        for p in procs:
            p.start()
        times = queue.get(timeout=1800)
        for p in procs:
            p.join()
    return times


def ray_worker(config: dict) -> None:
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    times = alternate(
        config["make_runners"], rank, config["blocks"], config["block_steps"], config["flip"]
    )
    if rank == 0:
        torch.save(times, config["out"])
    ray.train.report({"done": 1})


def run_in_ray(make_runners, blocks: int, block_steps: int, flip: bool = False) -> Times:
    """`alternate` in 2 Ray Train workers on a local Ray (the default job's processes);
    rank 0's times."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    here = str(Path(__file__).resolve().parent)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": f"{here}:{here}/.."}},
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/times.pt"
        config = {
            "make_runners": make_runners,
            "blocks": blocks,
            "block_steps": block_steps,
            "flip": flip,
            "out": out,
        }
        TorchTrainer(
            ray_worker,
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(storage_path=tmp, name="engine_vs_bare"),
        ).fit()
        return torch.load(out)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=100)
    parser.add_argument("--block-steps", type=int, default=10)
    parser.add_argument("--in-ray", action="store_true", help="as Ray Train workers")
    args = parser.parse_args()
    if args.in_ray:
        clocks = run_in_ray(engine_and_bare, args.blocks, args.block_steps)
    else:
        clocks = in_gloo_ranks(engine_and_bare, args.blocks, args.block_steps)
    times = {v: c["wall"] for v, c in clocks.items()}
    where = "Ray Train workers" if args.in_ray else "gloo ranks"
    print(
        f"MLP 64→256→256→10, 2 {where} × micro {MICRO} × accum {ACCUM}, fused AdamW; "
        f"{args.blocks} alternating blocks of {args.block_steps} steps each"
    )
    stats = {
        v: {
            "mean": statistics.mean(t),
            "median": statistics.median(t),
            "p20": statistics.quantiles(t, n=5)[0],
        }
        for v, t in times.items()
    }
    for v, st in stats.items():
        print(
            f"{v:7} step ms: mean {st['mean'] * 1e3:.3f}  median {st['median'] * 1e3:.3f}  "
            f"p20 {st['p20'] * 1e3:.3f}"
        )
    b, e = stats["bare"], stats["engine"]
    print(
        f"throughput ratio engine / bare: {b['mean'] / e['mean']:.3f} (mean step time; "
        f"median {b['median'] / e['median']:.3f}, p20 {b['p20'] / e['p20']:.3f})"
    )


if __name__ == "__main__":
    main()
