"""A spot reclaim with notice, on a real multi-node Ray cluster on loopback: the instance
metadata announces it, the spot agent (run as the cluster specs run it, started again and
again) drains the worker node for preemption once, and the node is removed at the deadline.
No step may be recomputed, the group must end as soon as the
last checkpoint is written, and the run must end with the weights of the uninterrupted
single-process run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.services.cluster import (
    add_node,
    final_checkpoint,
    job,
    notice_outcomes,
    reference_weights,
    rel_diff,
    run_record,
    train,
    wait_for_checkpoint,
    wait_for_slots,
    weights,
)
from tests.support.services.spot import reclaim_with_the_agent

pytestmark = [pytest.mark.ray, pytest.mark.cluster]
STEPS = 40
# the ranks learn of a notice after the agent's start, its `ray drain-node` (each a Python
# start: seconds on a loaded machine), Ray Train's watcher (every 5 s) and a window: 15 s left
# a loaded CI machine too little for the last checkpoint
NOTICE_S = 25


def test_spot_reclaim_with_notice_is_preempted_without_losing_a_step(
    tmp_path, loopback, record_equivalence
):
    cluster = loopback
    node = add_node(cluster)
    wait_for_slots(cluster, 2)
    spec = job(
        tmp_path,
        "spot",
        [1, 2],
        # about 1 s a step on 2 workers (4 forwards each), 2 s on 1
        model={"kwargs": {"delay_s": 0.25}},
        train={"max_steps": STEPS, "epochs": 5, "checkpoint_every_steps": 4},
        scaling={"resize_interval_s": 2},
    )
    agent_log = tmp_path / "agent.log"

    def during():
        wait_for_checkpoint(tmp_path / "spot", 4)
        reclaim_with_the_agent(cluster, node, tmp_path, agent_log, NOTICE_S)

    out = train(spec, cluster, Path(cluster["RAYACC_CLUSTER_ENV"]), during=during).stdout
    # Ray's own reports (a dead worker's raylet log) would fill the failure messages below
    out = "\n".join(line for line in out.splitlines() if "[state-dump]" not in line)
    said = agent_log.read_text()
    # one drain for the notice, however often the agent was started again
    assert said.count("draining this Ray node") == 1, said
    assert "staying out of the way" in said, said

    # the reclaimed node holds rank 1 or rank 0: Ray Train numbers the workers
    notice = re.search(r"preemption notice at step (\d+): node \w+ \(ranks [01]\) is rec", out)
    assert notice, out[-4000:]
    console_says, tag_says = notice_outcomes(int(notice.group(1)))
    assert re.search(console_says, out), out[-4000:]
    last = re.search(r"last checkpoint before the reclaim at step (\d+)", out)
    assert last, out[-4000:]
    # ... after which the group ends at once (rank 0 brings the drain's deadline forward)
    # rather than idling until the deadline
    assert re.search(
        rf"reclaim at step {last.group(1)}, \d+ s before the deadline; the group ends now", out
    ), out[-4000:]
    noticed_at, last_at = int(notice.group(1)), int(last.group(1))
    assert 4 < noticed_at < last_at < STEPS, (noticed_at, last_at)
    # the group restarts without the node from the last checkpoint: not one step again
    assert f"resize at step {last_at}: workers 2 → 1" in out, out[-4000:]
    # the first group had both nodes (one that grew before its first checkpoint redoes steps)
    assert "restarted from the beginning" not in out, out[-4000:]
    assert "0 steps recomputed" in out, out[-3000:]
    # ... at once: the next group is sized without the draining node (Ray's elastic sizing
    # counted it out when the group ended), not tried at the old size first — what is left of
    # the recovery beyond the new group's own start is the controller's reaction
    recovery = re.search(
        r"reclaim: notice → deadline ([\d.]+) s, deadline → training again ([\d.]+) s "
        r"\(group start ([\d.]+) s\), steps recomputed (\d+)",
        out,
    )
    assert recovery, out[-4000:]
    back_s, start_s = float(recovery.group(2)), float(recovery.group(3))
    assert recovery.group(4) == "0" and back_s <= start_s + 5, recovery.group(0)

    run, series = run_record(tmp_path, "spot")
    assert series("scaling/num_workers") == [2] * last_at + [1] * (STEPS - last_at)
    assert set(series("scaling/global_batch_size")) == {32}
    assert set(series("train/lr")) == {0.05}
    assert len(series("train/loss")) == STEPS
    assert series("goodput/steps_recomputed") == [0]
    # one restart without the node; on a loaded machine Ray Train may start one more group
    # before the reclaimed node is gone (it trains no step: the worker counts above say so)
    (restarts,) = series("goodput/restarts")
    assert restarts >= 1, restarts
    (fraction,) = series("goodput/fraction")
    assert 0 < fraction < 1
    tag = run.data.tags["rayacc.preemptions"]
    assert re.search(tag_says, tag), tag
    assert re.search(rf"step {last_at}: last checkpoint, [\d.]+ s before the deadline", tag), tag

    # the console is rayacc's: Ray Train's and the workers' own log lines stay in the cluster
    assert "RayTrainWorker" not in out and "TrainController" not in out, out[:3000]

    # the run's course: workers, global batch and accumulation over time, events marked
    report = subprocess.run(
        [
            sys.executable,
            "-m",
            "rayacc.cli",
            "report",
            run.info.run_id,
            "--tracking-uri",
            f"sqlite:///{tmp_path / 'mlflow.db'}",
            "--out",
            str(tmp_path / "report"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stdout + report.stderr
    assert "workers: 2 → 1" in report.stdout and "accumulation: 4 → 8" in report.stdout
    assert f"step {noticed_at}: preemption: node" in report.stdout, report.stdout
    assert (tmp_path / "report" / "scaling_over_time.png").stat().st_size > 10_000

    err = rel_diff(weights(final_checkpoint(tmp_path, "spot", STEPS)), reference_weights(spec))
    record_equivalence("spot reclaim with notice: 2 → 1 workers vs one process, full batch", err)
    assert err <= 1e-5, err
