"""Goodput of a spot reclaim, end to end, on a real multi-node Ray cluster on this machine
(cluster/local.sh): a 2-worker elastic run of 40 steps (about 1 s each on 2 workers, 2 s on 1)
that checkpoints every 30 steps loses worker node 1 to a reclaim with a notice of --notice-s
seconds, announced once step 4 is done, so that the deadline falls before the periodic
checkpoint (the "checkpoint every 1000 steps, reclaimed at 999" case): once with rayacc's
handling of the notice (`train.checkpoint_on_preemption: true`, the default) and once without
it. The reclaim is a cloud's: the instance metadata announces it (AWS's protocol) and the spot
agent drains the node, run as the cluster specs run it (started again whenever it exits, and
killed every 3 s besides); the node is removed at the deadline.

Prints, per run, `reclaim: notice → deadline X s, deadline → training again Y s (group start
Z s), steps recomputed N`, and each run's goodput split from its MLflow record.

    .venv/bin/python bench/spot_goodput.py [--notice-s 30]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PORT = "29479"
STEPS = 40


def local(env: dict, *args: str) -> str:
    proc = subprocess.run(
        ["bash", "cluster/local.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"cluster/local.sh {' '.join(args)} failed:\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def spec(folder: Path, name: str, handle_notice: bool) -> Path:
    """The elastic test's job (tests/cluster/test_elastic.py) at about 1 s a step on 2 workers."""
    from tests.support.services.cluster import job

    return job(
        folder,
        name,
        [1, 2],
        model={"kwargs": {"delay_s": 0.25}},
        train={
            "max_steps": STEPS,
            "epochs": 5,
            "checkpoint_every_steps": 30,
            "checkpoint_on_preemption": handle_notice,
        },
        scaling={"resize_interval_s": 2},
    )


RECLAIM = re.compile(
    r"reclaim: notice → deadline ([\d.]+) s, deadline → training again ([\d.]+) s \(group start "
    r"([\d.]+) s\), steps recomputed (\d+)"
)
"""rayacc's own line when the ranks handled the notice (its notice: when they learned of it)."""
BACK = re.compile(
    r"back to training at step \d+: group end → training again [\d.]+ s \(group start ([\d.]+) "
    r"s\), steps recomputed (\d+)"
)
"""rayacc's line for a group that ended without a notice handled: the deadline is this script's."""


def run(folder: Path, env: dict, name: str, handle_notice: bool, node: int, notice_s: int):
    gcs = dict(
        line.removeprefix("export ").split("=", 1)
        for line in (folder / "cluster" / "env").read_text().splitlines()
    )["RAYACC_GCS_ADDRESS"]
    from tests.support.services.spot import reclaim_with_the_agent

    cluster = dict(env, RAYACC_CLUSTER_ENV=str(folder / "cluster" / "env"))
    agent = folder / f"agent-{name}"  # its record of the notice, its log
    agent.mkdir()
    log = agent / "agent.log"
    thread = threading.Thread(
        target=reclaim_with_the_agent, args=(cluster, node, agent, log, notice_s)
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "rayacc.cli", "train", "-c", str(spec(folder, name, handle_notice))],
        cwd=ROOT,
        env=dict(env, RAY_ADDRESS=gcs, RAY_AUTH_MODE="token"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out = []
    timeline = {}
    recovery = None
    for line in proc.stdout:
        out.append(line)
        now = time.monotonic()
        # once: a run that starts over prints step 4 again
        if f"step 4/{STEPS}" in line and thread.ident is None:
            thread.start()
            timeline["notice"] = now  # the metadata announces it at once; the agent drains
        if "last checkpoint before the reclaim" in line:
            timeline["last checkpoint"] = now
        if "resize at step" in line or "restart at step" in line:
            timeline.setdefault("resized", now)
        if m := RECLAIM.search(line):
            recovery = tuple(float(g) for g in m.groups())
        elif (m := BACK.search(line)) and "notice" in timeline:
            # the deadline as the agent was told it, on this script's clock
            back = now - timeline["notice"] - notice_s
            recovery = (float(notice_s), back, float(m.group(1)), float(m.group(2)))
        if "resized" in timeline and re.search(rf"step \d+/{STEPS}", line):
            timeline.setdefault("training again", now)
    proc.wait()
    thread.join()
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{''.join(out)[-5000:]}")
    drains = log.read_text().count("draining this Ray node")
    if drains != 1:
        raise SystemExit(f"{name}: the agent drained {drains} times:\n{log.read_text()}")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    # a run that started over from no checkpoint continues in a new MLflow run (the first is
    # kept, KILLED): the finished one holds the fit's goodput
    (r,) = client.search_runs(
        [client.get_experiment_by_name(name).experiment_id],
        filter_string="attributes.status = 'FINISHED'",
    )
    split = {
        k.removeprefix("goodput/"): v for k, v in r.data.metrics.items() if k.startswith("goodput/")
    }
    times = {k: v - timeline["notice"] for k, v in timeline.items() if "notice" in timeline}
    return split, times, recovery


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--notice-s", type=int, default=30)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="rayacc-spot-"))
    env = dict(
        os.environ,
        RAYACC_LOCAL_DIR=str(folder / "cluster"),
        RAYACC_LOCAL_PORT=PORT,
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    env.pop("RAY_ADDRESS", None)
    results = {}
    try:
        local(env, "up", "1")
        results["with notice handling"] = run(folder, env, "with", True, 1, args.notice_s)
        local(env, "add")  # worker node 2 replaces the reclaimed one
        results["periodic checkpoints only"] = run(folder, env, "without", False, 2, args.notice_s)
    finally:
        local(env, "down")
    print(
        f"spot reclaim after step 4, {args.notice_s} s notice, 2 → 1 workers, {STEPS} steps, "
        "periodic checkpoint every 30"
    )
    for label, (_, _, r) in results.items():
        line = (
            "no recovery line"
            if r is None
            else f"reclaim: notice → deadline {r[0]:.1f} s, deadline → training again {r[1]:.1f} s "
            f"(group start {r[2]:.1f} s), steps recomputed {int(r[3])}"
        )
        print(f"{label:28}{line}")
    head = f"{'':28}{'goodput':>8}{'training':>10}{'restarts':>10}{'ckpt':>7}"
    print(head + f"{'recomputed':>12}{'steps':>7}{'wall':>8}")
    for label, (s, _, _) in results.items():
        print(
            f"{label:28}{s['fraction']:>8.1%}{s['training_s']:>9.1f}s{s['restarts_s']:>9.1f}s"
            f"{s['checkpoint_s']:>6.1f}s{s['recomputed_s']:>11.1f}s"
            f"{int(s['steps_recomputed']):>7}{s['wall_s']:>7.1f}s"
        )
    print(f"seconds after the notice (the deadline: {args.notice_s} s)")
    for label, (_, times, _) in results.items():
        shown = ", ".join(f"{k} {v:.1f}" for k, v in times.items() if k != "notice")
        print(f"{label:28}{shown}")
    on, off = (results[k][0] for k in results)
    # goodput's fraction counts the kept steps' time, which grows when more of them run on
    # fewer workers: the wall time and the steps done twice are the comparison
    print(f"ratio wall with / without: {on['wall_s'] / off['wall_s']:.2f}")
    print(f"ratio goodput with / without: {on['fraction'] / off['fraction']:.2f}")


if __name__ == "__main__":
    main()
