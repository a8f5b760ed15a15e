"""The accumulation step alone against a bare DDP loop, in 2 plain gloo processes (no Ray): the
same MLP, micro-batches and AdamW; the bare loop does no_sync on non-final micro-steps and
mean loss / accum, the engine its item-count normalisation, window statistics, gradient norm
and accounting. Runs the two alternately and prints median step times and their ratio.

    .venv/bin/python bench/cpu_engine_vs_bare.py [--repeats 3] [--steps 300]
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

MICRO, ACCUM, WARMUP = 32, 4, 20


def rank_body(rank: int, world: int, init: str, variant: str, steps: int, queue) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = torch.randn(4096, 64), torch.randint(0, 10, (4096,))
    model = DDP(MLP(64, 10, [256, 256]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = AccumulationStep(model, opt) if variant == "engine" else None
    times = []
    for s in range(steps):
        t = time.perf_counter()
        start = (s * MICRO * ACCUM) % (4096 - MICRO * ACCUM)
        mbs = [
            {"features": x[i : i + MICRO], "label": y[i : i + MICRO]}
            for i in range(start, start + MICRO * ACCUM, MICRO)
        ]
        if step is not None:
            step(mbs, classification_item_losses)
        else:
            opt.zero_grad(set_to_none=True)
            for i, mb in enumerate(mbs):
                # no_sync around forward and backward: DDP arms the all-reduce in forward
                sync = contextlib.nullcontext() if i == ACCUM - 1 else model.no_sync()
                with sync:
                    (F.cross_entropy(model(mb["features"]), mb["label"]) / ACCUM).backward()
            opt.step()
        times.append(time.perf_counter() - t)
    if rank == 0:
        queue.put(statistics.median(times[WARMUP:]))
    dist.destroy_process_group()


def run(variant: str, steps: int) -> float:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=rank_body, args=(r, 2, f"{tmp}/init", variant, steps, queue))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        result = queue.get(timeout=600)
        for p in procs:
            p.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    bare, engine = [], []
    for _ in range(args.repeats):
        bare.append(run("bare", args.steps))
        engine.append(run("engine", args.steps))
    b, e = statistics.median(bare), statistics.median(engine)
    print(f"MLP 64→256→256→10, 2 gloo ranks × micro {MICRO} × accum {ACCUM}, AdamW")
    for label, med, runs in (("bare DDP loop", b, bare), ("engine step", e, engine)):
        each = ", ".join(f"{v * 1e3:.2f}" for v in runs)
        print(f"{label:14} median step {med * 1e3:.2f} ms  (runs: {each})")
    print(f"throughput ratio engine / bare: {b / e:.3f}")


if __name__ == "__main__":
    main()
