"""HSDP through the whole stack on a real two-node Ray cluster on loopback (cluster/local.sh):
4 workers, 2 on each node; `fsdp.replicate: auto` lays a 2 × 2 mesh from the placement the
group got (each shard group on one node, the replica groups across the two), and the run (its
shards offloaded to host memory) ends on the weights of the single-process full-batch steps, a
short last window included."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.services.cluster import (
    add_node,
    final_checkpoint,
    job,
    local,
    reference_weights,
    rel_diff,
    run_record,
    train,
    wait_for_slots,
    weights,
)

pytestmark = [pytest.mark.ray, pytest.mark.cluster]
ROWS, STEPS = 240, 8
"""7 windows of 32 rows and a short one of 16."""


def test_hsdp_with_offload_on_two_nodes_equals_the_full_batch_steps(
    tmp_path, loopback, record_equivalence
):
    # one run (a group start each costs the suite): the reduce-scatter-only micro-steps and
    # the shards in host memory; tests/distributed/test_hsdp.py proves each mode and offload
    # apart on gloo ranks
    grad_sync, offload = "every_micro_step", "cpu"
    cluster, env_file = loopback, Path(loopback["RAYACC_CLUSTER_ENV"])
    node = add_node(cluster)
    try:
        wait_for_slots(cluster, 2)
        spec = job(
            tmp_path,
            "hsdp",
            4,
            rows=ROWS,
            model={"kwargs": {"delay_s": 0.0}},
            train={"strategy": "fsdp", "max_steps": STEPS, "epochs": 1},
            fsdp={"replicate": "auto", "grad_sync": grad_sync, "offload": offload},
            # two workers on each node (one slot each)
            scaling={"extra_resources": {"worker_slot": 0.5}},
        )
        out = train(spec, cluster, env_file).stdout
    finally:
        local("remove", str(node), env=cluster)
    run, series = run_record(tmp_path, "hsdp")
    assert run.data.tags["rayacc.mesh"].startswith("FSDP mesh 2 × 2"), run.data.tags
    assert "replicate auto: 2 nodes" in out, out[-3000:]
    nodes = run.data.tags["rayacc.worker_nodes"].split(",")
    assert len(set(nodes)) == 2, nodes
    assert series("train/samples") == [32] * 7 + [16]
    # one FSDP unit (the model has no blocks): the sharded gradients all-reduced across the
    # replica groups once per window; reduce-scattered inside them per micro-step or once
    assert series("comm/allreduce_calls") == [1] * STEPS
    assert series("comm/reduce_scatter_calls") == [2] * 7 + [1]
    windows = [(32 * s, 32 if s < 7 else 16, 0.05) for s in range(STEPS)]
    err = rel_diff(
        weights(final_checkpoint(tmp_path, "hsdp", STEPS)), reference_weights(spec, windows)
    )
    record_equivalence(
        f"HSDP 2 × 2 on two nodes, {grad_sync}, offload {offload}, SGD, short last window", err
    )
    assert err <= 1e-5, err
