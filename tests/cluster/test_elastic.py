"""Elastic runs on a real multi-node Ray cluster on loopback (cluster/local.sh): a node leaves or
joins mid-run; the global batch, the effective LR and the data order carry on."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.services.cluster import (
    add_node,
    final_checkpoint,
    hold,
    job,
    local,
    reference_weights,
    rel_diff,
    run_record,
    train,
    wait_for_slots,
    wait_then,
    weights,
)

pytestmark = [pytest.mark.ray, pytest.mark.cluster]


def test_node_leaves_and_joins_with_global_batch_and_lr_kept(
    tmp_path, loopback, record_equivalence
):
    cluster, env_file = loopback, Path(loopback["RAYACC_CLUSTER_ENV"])
    nodes = [add_node(cluster)]

    # the single-process full-batch run: what every size, and every change of size, must give
    reference = reference_weights(job(tmp_path, "fixed", 2))
    wait_for_slots(cluster, 2)

    # 2 workers (accumulation 4 each) on 2 nodes; node 1 is lost in step 5: 1 worker
    # (accumulation 8) goes on from checkpoint 4, held in step 9 until a node joins: 2 workers
    # again from checkpoint 8
    out = train(
        job(
            tmp_path,
            "elastic",
            [1, 2],
            model=hold(tmp_path, "elastic", w2=16, w1=32),
            scaling={"resize_interval_s": 2},
        ),
        cluster,
        env_file,
        during=wait_then(
            tmp_path,
            "elastic",
            (4, lambda: local("remove", str(nodes[0]), env=cluster)),
            (8, lambda: nodes.append(add_node(cluster))),
        ),
    ).stdout
    assert "resize at step 4" in out and "workers 2 → 1" in out, out[-3000:]
    assert "resize at step 8" in out and "workers 1 → 2" in out, out[-3000:]
    run, series = run_record(tmp_path, "elastic")
    workers = series("scaling/num_workers")
    assert workers == [2] * 4 + [1] * 4 + [2] * 8, workers
    assert set(series("scaling/global_batch_size")) == {32}
    assert series("scaling/grad_accum_steps") == [4] * 4 + [8] * 4 + [4] * 8
    assert set(series("train/lr")) == {0.05}
    assert len(series("train/loss")) == 16, "optimizer steps are contiguous, none repeated"
    resizes = run.data.tags["rayacc.resizes"]
    assert "step 4: workers 2→1, accum 4→8, global 32→32" in resizes, resizes
    assert "step 8: workers 1→2, accum 8→4, global 32→32" in resizes, resizes
    err = rel_diff(weights(final_checkpoint(tmp_path, "elastic")), reference)
    record_equivalence("elastic: 2 → 1 → 2 workers at steps 4, 8 vs one process, full batch", err)
    assert err <= 1e-5, err

    # keep_micro_batch under DeepSpeed ZeRO-2 and AdamW, and a checkpoint that never became
    # whole: node 1 goes after rank 1's DeepSpeed files of checkpoint 4 are in storage, before
    # its part manifest (taken away here). The group of 1 passes checkpoint 4 over (rank 1's
    # files in it are strangers), resumes checkpoint 2's ZeRO partitions through DeepSpeed's
    # universal checkpoint, and writes step 4 again in a folder of its own; accumulation stays
    # 4, the global batch follows the workers (32 → 16) and the LR the linear rule (0.005 →
    # 0.0025) over a 5-step re-warmup
    wait_for_slots(cluster, 2)
    spec = job(
        tmp_path,
        "micro",
        [1, 2],
        model=hold(tmp_path, "micro", w2=16),
        scaling={"resize_interval_s": 2, "on_resize": "keep_micro_batch"},
        train={"strategy": "deepspeed"},
        deepspeed={"stage": 2},
        optim={"name": "adamw", "momentum": 0.0, "lr": 0.005},
    )

    def rank_1_goes_before_its_manifest():
        (torn,) = (tmp_path / "micro").glob("*/checkpoint_step00000004")
        manifest = torn / "parts" / "rank_00001.json"
        deadline = time.monotonic() + 60
        while not manifest.is_file():
            assert time.monotonic() < deadline, "rank 1's part of checkpoint 4 never arrived"
            time.sleep(0.2)
        assert (torn / "zero" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
        manifest.unlink()
        local("remove", str(nodes[1]), env=cluster)
        # the group of 1 writes step 4 again beside the torn folder, never into it (both
        # are gone by the run's end: Ray Train's retention keeps the newest two)
        again = torn.parent / "checkpoint_step00000004_attempt2" / "meta.json"
        while not again.is_file():
            assert time.monotonic() < deadline + 300, "step 4 was not written again"
            time.sleep(0.2)

    out = train(
        spec,
        cluster,
        env_file,
        during=wait_then(tmp_path, "micro", (4, rank_1_goes_before_its_manifest)),
    ).stdout
    assert "resize at step 2" in out and "workers 2 → 1" in out, out[-3000:]
    run, series = run_record(tmp_path, "micro")
    from rayacc.tracking.history import discarded_marks

    apart = [(m.first, m.last) for m in discarded_marks(run.data.tags)]
    assert apart == [(3, 4)], apart  # steps 3 and 4 of the torn checkpoint's group, marked
    assert series("scaling/num_workers") == [2] * 2 + [1] * 14
    assert series("scaling/grad_accum_steps") == [4] * 16
    assert series("scaling/global_batch_size") == [32] * 2 + [16] * 14
    assert series("train/samples") == [32] * 2 + [16] * 14
    expected_lr = [0.005] * 2 + [0.005 - 0.0025 * min(k, 5) / 5 for k in range(14)]
    assert series("train/lr") == pytest.approx(expected_lr, rel=1e-9), series("train/lr")
    assert "step 2: workers 2→1, accum 4→4, global 32→16" in run.data.tags["rayacc.resizes"]
    # 2 windows of 32 rows, then 14 of 16 from row 64 (the epoch's end at row 256, then the
    # second epoch from row 0), at the LRs logged
    windows = [(32 * s, 32, 0.005) for s in range(2)]
    windows += [((64 + 16 * k) % 256, 16, lr) for k, lr in enumerate(expected_lr[2:])]
    err = rel_diff(weights(final_checkpoint(tmp_path, "micro")), reference_weights(spec, windows))
    record_equivalence(
        "elastic deepspeed zero2 adamw: checkpoint 4 torn, 2 → 1 workers from step 2, keep micro",
        err,
    )
    assert err <= 1e-5, err
