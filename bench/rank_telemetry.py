"""What the per-rank telemetry costs the default job's step: the accumulation step of
jobs/digits.yaml (MLP 64→128→128→10, micro 32 × accumulation 4, AdamW) on 2 gloo ranks, with
and without every rank's figures riding the window's reduction and rank 0 handing them over
with the step's record, as the worker loop does both (the driver judges them, off the step:
`observe/relay.py`). `bench/rank_telemetry_job.py` measures the same in the default job's own
loop.

Both run in the same two processes, alternating in blocks of steps, so that whatever else the
machine does hits both alike. Prints each one's median and mean step time, the cost measured
on two clocks with a bootstrap 95 % interval each, and ends with

    per-rank telemetry cost / step: X % wall, Y % CPU      (target: at most 1 %)

wall: the telemetry side's step time over the plain side's; CPU: rank 0's extra CPU time per
step over the plain step's wall time. CPU time leaves out the time a rank waits for a core or
for its peer, the wall measure's main noise, and rank 0 does all the other ranks do and more.

    .venv/bin/python bench/rank_telemetry.py [--blocks 400] [--block-steps 5] [--same]
"""

from __future__ import annotations

import argparse
import functools
import pickle
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_engine_vs_bare import ACCUM, MICRO, in_gloo_ranks, run_in_ray

from rayacc.checkpoint import StepLog
from rayacc.config.batch_split import BatchSplit
from rayacc.engine import AccumulationStep, classification_item_losses
from rayacc.models.mlp import MLP
from rayacc.observe.ranks import FIGURES_KEY, rank_figures
from rayacc.worker.metrics import step_record
from rayacc.worker.progress import Outbox
from rayacc.worker.system import ResidentMemory

VARIANTS = ("plain", "telemetry")


class _Pickled:
    """The driver's progress buffer as rank 0's `Outbox` reaches it: `push.remote(items)`
    pickles the batch (what Ray does with it), and nothing more."""

    class _Push:
        @staticmethod
        def remote(items) -> None:
            pickle.dumps(items)

    push = _Push()


SPLIT = BatchSplit(MICRO * ACCUM * 2, MICRO, ACCUM, 2)


class Runner:
    """One side of the comparison over a shared step, doing per window what the worker loop
    does after its step: the step's record, kept in rank 0's lineage (`StepLog`, a JSON line
    in a spool file) and sent to the driver in batches (`Outbox`, its batch pickled).
    `telemetry` adds what the loop adds per window: this rank's figures of the last window
    in, and everyone's, as the reduction brought them, in rank 0's hand-over of the record
    (the driver judges them, off the step)."""

    def __init__(self, step: AccumulationStep, telemetry: bool, rank: int):
        self.step = step
        self.telemetry = telemetry
        self.report: list[float] = []
        self.resident = ResidentMemory()
        self.outbox = Outbox(_Pickled() if rank == 0 else None)
        self.history = StepLog() if rank == 0 else None
        self.n = 0

    def __call__(self, mbs) -> None:
        t = time.perf_counter()
        result = self.step(mbs, classification_item_losses, figures=self.report)
        self.n += 1
        wall_s = time.perf_counter() - t
        # both read the host memory: the loop does for `mem/rss_mb` with or without telemetry
        rss_mb = self.resident.mb()
        if self.telemetry:
            self.report = rank_figures(
                step_s=result.step_time_s,
                sync_s=result.sync_time_s,
                optimizer_s=result.optimizer_time_s,
                data_s=wall_s - result.step_time_s,
                host_mb=rss_mb,
                device_mb=result.peak_memory_mb,
            )
        record = step_record(
            result,
            step=self.n,
            epoch=0,
            wall_s=wall_s,
            data_s=0.0,
            split=SPLIT,
            micro_now=MICRO,
            accum_now=ACCUM,
            skipped_steps=0,
            rows_read=self.n * MICRO * ACCUM,
            rss_mb=rss_mb,
            flops_per_item=None,
            peak_tflops=None,
            token_items=False,
        )
        if self.history is not None:
            self.history.append(record)
        handed = dict(record)
        if result.group_figures:
            handed[FIGURES_KEY] = result.group_figures
        self.outbox.send(handed)


def runners(rank: int, same: bool) -> dict:
    """Both sides train one model, optimizer and DDP instance: two instances would differ by
    where their memory lies (an A/A of two instances reads about −0.3 %). `same`: both sides
    without telemetry, to see what the measurement itself varies by."""
    torch.manual_seed(0)
    model = DDP(MLP(64, 10, [128, 128]))
    step = AccumulationStep(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    return {v: Runner(step, v == "telemetry" and not same, rank) for v in VARIANTS}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=400)
    parser.add_argument("--block-steps", type=int, default=5)
    parser.add_argument("--same", action="store_true", help="no telemetry on either side (A/A)")
    parser.add_argument(
        "--in-ray", action="store_true", help="as 2 Ray Train workers, as the default job runs"
    )
    args = parser.parse_args()
    run = run_in_ray if args.in_ray else in_gloo_ranks
    clocks = run(
        functools.partial(runners, same=args.same), args.blocks, args.block_steps, flip=True
    )
    where = "Ray Train workers" if args.in_ray else "gloo ranks"
    print(
        f"the default job's step (MLP 64→128→128→10, 2 {where} × micro {MICRO} × accum "
        f"{ACCUM}, AdamW); {args.blocks} alternating blocks of {args.block_steps} steps"
    )
    for v, c in clocks.items():
        print(
            f"{v:9} step ms: median {statistics.median(c['wall']) * 1e3:.3f}  mean "
            f"{statistics.mean(c['wall']) * 1e3:.3f}  CPU median "
            f"{statistics.median(c['cpu']) * 1e3:.3f}"
        )
    wall, cpu = block_costs(clocks, args.block_steps)
    label = "the same step twice (A/A)" if args.same else "per-rank telemetry cost / step"
    print_costs(wall, cpu, label)


def print_costs(wall: list[float], cpu: list[float], label: str) -> None:
    """Each clock's median cost over the block pairs with its bootstrap interval; then the
    line the figures are read from: `LABEL: X % wall, Y % CPU`."""
    for name, costs in (("wall", wall), ("CPU", cpu)):
        low, high = interval95(costs)
        print(
            f"{name:4} cost / step: {statistics.median(costs) * 100:.2f} % "
            f"(95 % interval {low * 100:.2f} … {high * 100:.2f} %)"
        )
    wall_cost, cpu_cost = statistics.median(wall) * 100, statistics.median(cpu) * 100
    print(f"{label}: {wall_cost:.2f} % wall, {cpu_cost:.2f} % CPU")


def block_costs(clocks: dict, k: int) -> tuple[list[float], list[float]]:
    """Per pair of blocks, the telemetry side's extra time over the plain side's step: wall
    (the ratio of their median step times, less one) and CPU (the extra median CPU time of
    rank 0, which does everything the other ranks do and judges them too, over the plain
    step's median wall time). Within a pair, what the machine did meanwhile hits both alike;
    CPU time leaves out the time the process waited (for a core, for the other rank), the
    wall measure's main noise."""
    tel, plain = clocks["telemetry"], clocks["plain"]
    wall, cpu = [], []
    for i in range(0, len(plain["wall"]), k):
        base = statistics.median(plain["wall"][i : i + k])
        wall.append(statistics.median(tel["wall"][i : i + k]) / base - 1)
        extra = statistics.median(tel["cpu"][i : i + k]) - statistics.median(
            plain["cpu"][i : i + k]
        )
        cpu.append(extra / base)
    return wall, cpu


def interval95(costs: list[float], resamples: int = 1000) -> tuple[float, float]:
    """A bootstrap 95 % interval of the median over the block pairs: how far the figure would
    move on another run of as many pairs (not what differs between runs for other reasons,
    which `--same` shows)."""
    rng = random.Random(0)
    n = len(costs)
    medians = sorted(statistics.median(rng.choices(costs, k=n)) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


if __name__ == "__main__":
    main()
