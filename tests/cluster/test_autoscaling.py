"""Ray's own autoscaler in the loop: `cluster/local.sh autoscale` starts a head whose
autoscaler (Ray's fake multi-node provider) launches worker nodes on this machine when work is
pending and stops them once idle. An elastic run `[1, 3]` starts on what there is (the head's
one worker slot), the autoscaler adds nodes for the workers Ray Train asks for, the group grows
with the global batch and the LR kept (at 3 workers in uneven shares of 11 + 11 + 10 rows), and
the nodes go once the run is over."""

from __future__ import annotations

import re
import time

import pyarrow.parquet as pq
import pytest

from rayacc.data.bundled import prepare_bundled
from tests.support.services.cluster import (
    final_checkpoint,
    hold,
    job,
    local,
    reference_weights,
    rel_diff,
    run_record,
    train,
    until,
    weights,
)

pytestmark = [pytest.mark.ray, pytest.mark.cluster]
STEPS = 12
GLOBAL = 32
"""Micro-batches of 4: accumulation 8 at 1 worker, 4 at 2; 3 workers share it 11 + 11 + 10,
each in 3 micro-steps (an autoscaler adding one node at a time passes through 3)."""


def test_autoscaler_adds_nodes_and_the_elastic_group_grows_with_global_batch_kept(
    tmp_path, cluster, record_equivalence
):
    out = local("autoscale", "2", env=cluster).stdout
    assert "autoscaling cluster up" in out, out
    assert local("nodes", env=cluster).stdout.strip() == "1"  # the head alone

    data = tmp_path / "d288.parquet"  # 9 whole windows of 32 rows
    pq.write_table(pq.read_table(prepare_bundled("digits")).slice(0, 288), data)
    spec = job(
        tmp_path,
        "grow",
        [1, 3],
        data={"source": str(data)},
        batch={"global_batch_size": GLOBAL, "micro_batch_size": 4},
        optim={"base_batch_size": GLOBAL},
        train={"max_steps": STEPS, "epochs": 2, "checkpoint_every_steps": 2},
        # a group is not resized in its first 15 s: on 2 cores the autoscaler's nodes are up
        # before the first group has started, which would otherwise be replaced at once
        scaling={"resize_interval_s": 15},
        # the first group of 1 (and of 2, if the nodes come one by one) waits after its
        # second step for the resize the autoscaler's nodes bring
        model=hold(tmp_path, "grow", w1=16, w2=8),
    )
    started = time.monotonic()
    out = train(spec, cluster, tmp_path / "cluster" / "env").stdout
    ran_s = time.monotonic() - started

    resizes = re.findall(r"resize at step (\d+): workers (\d) → (\d)", out)
    assert resizes and resizes[0][1] == "1" and resizes[-1][2] == "3", out[-4000:]
    assert "global batch 32 → 32, shares 11 + 11 + 10, effective LR" in out, out[-4000:]
    run, series = run_record(tmp_path, "grow")
    workers = series("scaling/num_workers")
    assert workers[:2] == [1, 1] and workers[-1] == 3 and workers == sorted(workers), workers
    assert set(series("scaling/global_batch_size")) == {GLOBAL}
    accum = {1: 8, 2: 4, 3: 3}
    assert series("scaling/grad_accum_steps") == [accum[int(w)] for w in workers]
    shares = {1: (32, 32), 2: (16, 16), 3: (11, 10)}
    ran = list(zip(series("scaling/share_max"), series("scaling/share_min"), strict=True))
    assert ran == [shares[int(w)] for w in workers], ran
    assert set(series("train/lr")) == {0.05}
    assert len(series("train/loss")) == STEPS
    assert "workers 1→" in run.data.tags["rayacc.resizes"]

    err = rel_diff(weights(final_checkpoint(tmp_path, "grow", STEPS)), reference_weights(spec))
    record_equivalence("autoscaler: 1 → 3 workers as nodes come vs one process, full batch", err)
    assert err <= 1e-5, err

    # the autoscaler stops the idle nodes (idle_timeout_minutes 0.25)
    until(cluster, "nodes", "1", timeout_s=120)
    print(f"autoscaled run: {ran_s:.0f} s, resizes {resizes}")
