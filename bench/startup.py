"""Where the default job's wall time goes, from command to exit.

Runs `rayacc train -c jobs/digits.yaml --timings FILE` as a user would (a new process in a fresh
folder: a new MLflow store, a new local Ray) and prints each phase's seconds from the timestamps
the driver and rank 0 record, then the wall time from command to exit. With `--baseline-src DIR`
it also runs another checkout's `rayacc train` (e.g. a `git worktree` of an earlier commit) the
same way, alternating with this one, and prints the ratio of the medians of the wall times.

`--sweep` runs `rayacc sweep -c jobs/sweep_accum.yaml` instead (4 trials of a few training
steps each, one at a time on 2 cores) and prints the median wall time of a trial (the fit inside
it, as the sweep reports it: nearly all of it start-up and teardown) and of the whole command.

    .venv/bin/python bench/startup.py --repeats 3
    git worktree add /tmp/before <commit> && \
        .venv/bin/python bench/startup.py --repeats 3 --baseline-src /tmp/before
    .venv/bin/python bench/startup.py --sweep --repeats 1 --baseline-src /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (label, from, to): `spawn` is the command's start, `exit` its end; `d:` the driver's phases,
# `w:` rank 0's timeline
PHASES = [
    ("imports", "spawn", "d:imported"),
    ("config + checks (data, model)", "d:imported", "d:cli_checked"),
    ("Ray start (Ray Train, Ray Data load alongside)", "d:cli_checked", "d:cli_ray_started"),
    ("dataset + trainer", "d:ray_started", "d:fit_started"),
    ("MLflow store (overlaps the group's start)", "d:tracking_started", "d:tracking_opened"),
    ("worker group: actors to process start", "d:fit_started", "w:process_started"),
    ("worker: imports + process group", "w:process_started", "w:entered"),
    ("worker: model build", "w:entered", "w:built"),
    ("worker: its rows from the dataset", "w:built", "w:data"),
    ("first step", "w:data", "w:first_step"),
    ("training steps after the first", "w:first_step", "w:finished"),
    ("worker group teardown to fit()'s return", "w:finished", "d:trained"),
    ("tracking close (loss curve, status)", "d:trained", "d:tracking_closed"),
    ("summary + process exit", "d:tracking_closed", "exit"),
]


def rayacc(src: Path | None, args: list[str], cwd: str) -> tuple[float, str]:
    """Runs the `rayacc` command of this checkout (or of `src`) in `cwd` as a user would;
    (wall time from command to exit, stdout)."""
    # the command's entry point (`run` since the quick exit, `main` before it)
    code = (
        "import sys, rayacc.cli as c; "
        "(c.run if hasattr(c, 'run') else lambda: sys.exit(c.main()))()"
    )
    env = dict(os.environ, RAY_ADDRESS="")
    if src is not None:
        # the other checkout's package wins over the installed one
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True
    )
    wall = time.time() - t0
    if proc.returncode != 0:
        sys.exit(f"rayacc {args[0]} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return wall, proc.stdout


def run_once(src: Path | None, with_timings: bool) -> tuple[float, dict[str, float]]:
    """Wall time from command to exit, and the timestamps (empty without timings)."""
    with tempfile.TemporaryDirectory() as tmp:
        timings = Path(tmp) / "timings.json"
        args = ["train", "-c", str((src or ROOT) / "jobs" / "digits.yaml")]
        if with_timings:
            args += ["--timings", str(timings)]
        t0 = time.time()
        wall, _ = rayacc(src, args, tmp)
        t1 = t0 + wall
        stamps: dict[str, float] = {"spawn": t0, "exit": t1}
        if with_timings:
            data = json.loads(timings.read_text())
            stamps.update({f"d:{k}": v for k, v in data["driver"].items()})
            stamps.update({f"w:{k}": v for k, v in data["worker"].items()})
        return t1 - t0, stamps


def run_sweep_once(src: Path | None) -> tuple[float, list[float]]:
    """Wall time of `rayacc sweep` from command to exit, and each trial's wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        args = ["sweep", "-c", str((src or ROOT) / "jobs" / "sweep_accum.yaml")]
        wall, stdout = rayacc(src, args, tmp)
        trials = [float(t) for t in re.findall(r"trial \d+ finished: .*, ([\d.]+) s", stdout)]
        return wall, trials


def sweep_main(args: argparse.Namespace) -> None:
    rows = []
    for src, label in [(None, "this"), (args.baseline_src, "baseline")]:
        if label == "baseline" and src is None:
            continue
        for i in range(args.repeats):
            wall, trials = run_sweep_once(src)
            print(f"{label} sweep run {i + 1}: {wall:.1f} s, trials {trials}", flush=True)
            rows.append((label, wall, trials))
    for label in ("this", "baseline"):
        mine = [r for r in rows if r[0] == label]
        if mine:
            trial = statistics.median(t for r in mine for t in r[2])
            wall = statistics.median(r[1] for r in mine)
            print(f"{label:9s} median trial {trial:6.2f} s   sweep command to exit {wall:6.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline-src", type=Path, default=None)
    parser.add_argument("--sweep", action="store_true", help="time `rayacc sweep` instead")
    args = parser.parse_args()
    if args.sweep:
        sweep_main(args)
        return

    walls, baseline, runs = [], [], []
    for i in range(args.repeats):
        wall, stamps = run_once(None, with_timings=True)
        walls.append(wall)
        runs.append(stamps)
        print(f"run {i + 1}: {wall:.1f} s", flush=True)
        if args.baseline_src:
            wall_b, _ = run_once(args.baseline_src, with_timings=False)
            baseline.append(wall_b)
            print(f"baseline run {i + 1}: {wall_b:.1f} s", flush=True)

    print(f"\n{'phase':44s} {'median s':>9s}")
    for label, a, b in PHASES:
        values = [r[b] - r[a] for r in runs if a in r and b in r]
        if values:
            print(f"{label:44s} {statistics.median(values):9.2f}")
    print(f"{'command to exit':44s} {statistics.median(walls):9.2f}")
    if baseline:
        ratio = statistics.median(walls) / statistics.median(baseline)
        print(f"{'baseline command to exit':44s} {statistics.median(baseline):9.2f}")
        print(f"ratio this / baseline (medians): {ratio:.2f}")


if __name__ == "__main__":
    main()
