"""What the per-rank telemetry costs the default job's step, measured in the default job's own
worker loop: jobs/digits.yaml run by `rayacc`'s driver on a local Ray (2 Ray Train workers,
its data read, step, record, lineage and hand-over), lengthened to many windows, with the
telemetry on in every other block of windows and off in the others.

The telemetry is everything the worker loop does for it (`worker/telemetry.py` and the
hand-over): each rank's figures riding the next window's reduction, and rank 0 handing every
rank's figures over with the step's record; the driver judges them (`observe/relay.py`), off
the step. A window's report is made at the end of the window before it, so a block's reports
ride exactly its own windows; every rank switches at the same window, as the reduction's
length must agree.

Per window, rank 0 times `_window` and `_after_window` together (the step as the loop runs it:
data, step, record, lineage, hand-over; no validation or checkpoint is due), on the wall clock
and in its process's CPU time. Within each pair of blocks (which side goes first alternates),
the cost is the telemetry block's median over the plain block's, less one (wall), and rank 0's
extra median CPU time over the plain block's median wall time (CPU). Prints the median of each
over the pairs with a bootstrap 95 % interval, and ends with

    per-rank telemetry cost / default job step: X % wall, Y % CPU      (target: at most 1 %)

MLflow is off (the driver's logging of tens of thousands of windows would share the cores
with the workers); the default job logs to it from the driver, not from the step.

    .venv/bin/python bench/rank_telemetry_job.py [--windows 12000] [--block 5] [--same]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rank_telemetry import print_costs

from rayacc.worker.loop import WorkerRun

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = "RAYACC_BENCH_TELEMETRY"
"""`block,same,out`: handed to the workers through the environment of the Ray the driver
starts (they inherit it)."""


class AlternatingRun(WorkerRun):
    """The default job's worker loop with the telemetry on in every other block of windows."""

    def __init__(self, inputs):
        block, same, self.out = os.environ[SETTINGS].split(",", 2)
        self.block, self.same = int(block), same == "1"
        self.n = 0
        self.times: list[tuple[bool, float, float]] = []
        self.handed: list[bool] = []
        """Per window: whether rank 0 handed every rank's figures over with its record."""
        super().__init__(inputs)

    def side(self, n: int) -> bool:
        """Whether window n of the group is on the telemetry side: blocks alternate, and which
        side goes first alternates between pairs of blocks."""
        b = n // self.block
        return (b + b // 2) % 2 == 1

    def telemetry_on(self, n: int) -> bool:
        """Whether window n runs with the telemetry (`--same`: no window does)."""
        return self.side(n) and not self.same

    def _window(self, epoch, layout, s):
        self.started = time.perf_counter(), time.process_time()
        record = super()._window(epoch, layout, s)
        if not self.telemetry_on(self.n + 1):
            self.telemetry.figures = []  # the next window's reduction carries none
        return record

    def _after_window(self, record) -> None:
        super()._after_window(record)
        wall, cpu = time.perf_counter(), time.process_time()
        self.times.append((self.side(self.n), wall - self.started[0], cpu - self.started[1]))
        self.handed.append(bool(self.telemetry.group_figures))
        self.n += 1

    def train(self):
        summary = super().train()
        if self.rank == 0:
            torch.save((self.times, self.handed), self.out)
        return summary


def bench_train_loop(inputs):
    return AlternatingRun(inputs).train()


def block_costs(times, block: int) -> tuple[list[float], list[float]]:
    """Per pair of blocks: (telemetry median / plain median − 1) on the wall clock, and rank
    0's extra median CPU time over the plain block's median wall time."""
    by_block: dict[int, tuple[bool, list[float], list[float]]] = {}
    for n, (on, wall, cpu) in enumerate(times):
        _, walls, cpus = by_block.setdefault(n // block, (on, [], []))
        walls.append(wall)
        cpus.append(cpu)
    wall_costs, cpu_costs = [], []
    # the group's first two pairs warm up (the reads' first epochs, the allocator)
    for pair in range(2, len(by_block) // 2):
        a, b = by_block[2 * pair], by_block[2 * pair + 1]
        if len(a[1]) < block or len(b[1]) < block or a[0] == b[0]:
            continue
        tel, plain = (a, b) if a[0] else (b, a)
        base = statistics.median(plain[1])
        wall_costs.append(statistics.median(tel[1]) / base - 1)
        cpu_costs.append((statistics.median(tel[2]) - statistics.median(plain[2])) / base)
    return wall_costs, cpu_costs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--windows", type=int, default=12000)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--same", action="store_true", help="no telemetry on either side (A/A)")
    args = parser.parse_args()

    import yaml

    import rayacc.worker.loop as loop
    from rayacc.config import TrainConfig
    from rayacc.driver.fit import fit

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/times.pt"
        spec = yaml.safe_load((ROOT / "jobs/digits.yaml").read_text())
        windows_per_epoch = 6  # 1,527 training rows in windows of 256
        spec["train"].update(
            epochs=-(-args.windows // windows_per_epoch),
            max_steps=args.windows,
            val_every_steps=None,
            checkpoint_every_steps=None,
        )
        spec["tracking"] = {"enabled": False}
        spec["run"] = {"storage_path": f"{tmp}/runs"}
        cfg = TrainConfig.from_dict(spec)
        # the local Ray the driver starts, and so its workers, inherit these
        os.environ[SETTINGS] = f"{args.block},{int(args.same)},{out}"
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "bench"), str(ROOT), os.environ.get("PYTHONPATH", "")]
        )
        loop.train_loop = bench_train_loop
        t = time.perf_counter()
        result = fit(cfg)
        took = time.perf_counter() - t
        times, handed = torch.load(out)
    # the sides differ by the telemetry alone: every window of the one, none of the other
    on = [t[0] and not args.same for t in times]
    assert handed[1:] == on[1:], "a window's figures were handed over on the wrong side"

    wall, cpu = block_costs(times, args.block)
    print(
        f"the default job's step (jobs/digits.yaml, 2 Ray Train workers), {len(times)} windows "
        f"in blocks of {args.block} ({len(wall)} pairs); the run took {took:.0f} s"
    )
    for side in (False, True):
        w = [t[1] for t in times if t[0] == side]
        c = [t[2] for t in times if t[0] == side]
        if w:
            name = "telemetry" if side else "plain"
            print(
                f"{name:9} window ms: median {statistics.median(w) * 1e3:.3f}  mean "
                f"{statistics.mean(w) * 1e3:.3f}  CPU median {statistics.median(c) * 1e3:.3f}"
            )
    label = "the same step twice (A/A)" if args.same else "per-rank telemetry cost"
    print_costs(wall, cpu, f"{label} / default job step")
    assert result.history, "the run handed over no step records"


if __name__ == "__main__":
    main()
