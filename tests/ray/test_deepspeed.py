"""train.strategy=deepspeed through the whole stack on the suite's Ray: Ray Train workers run
DeepSpeed's engine at each ZeRO stage, with optimizer offload on and off, over a full window
and a short last one, and the steps equal the single-process full-batch steps; the model loads
from DeepSpeed's checkpoint files without DeepSpeed's runtime. ZeRO-3 resumes at another
worker count (DeepSpeed's universal checkpoint) between the two windows."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayacc import load_model
from tests.support.services.fits import (
    config,
    fit_or_fail,
    padded_token_loss,
    sgd_step_errors,
)

pytestmark = pytest.mark.ray
pytest.importorskip("deepspeed")

CASES = [(1, "cpu"), (2, "none"), (3, "cpu")]
"""(ZeRO stage, optimizer offload): each stage, offload on and off (the other three of the six
run on 2 gloo ranks: tests/distributed/test_deepspeed.py). ZeRO-3 takes its first window on 2
workers, then resumes on 1 for the second."""


@pytest.mark.parametrize("stage, offload", CASES, ids=[f"zero{s}-offload_{o}" for s, o in CASES])
def test_each_stage_through_the_whole_stack_equals_the_full_batch_steps(
    ray_local, tmp_path, record_equivalence, stage, offload
):
    """22 token rows of 2 to 20 tokens (shortest first), global batch 16 on 2 workers × micro
    2: a full window (4 micro-steps per rank), then a short last one of 6 rows (2 per rank,
    the second of one row); the GPT's embedding and head are one tied weight. Under ZeRO-3 the
    run stops after the full window and resumes on 1 worker (micro 2 × accumulation 8), its
    SGD momentum and weights resharded from 2 ranks' files."""
    rng = np.random.default_rng(stage)
    seqs = sorted((rng.integers(0, 17, rng.integers(2, 21)).tolist() for _ in range(22)), key=len)
    path = tmp_path / "tokens.parquet"
    pq.write_table(pa.table({"tokens": pa.array(seqs, pa.list_(pa.uint16()))}), path)
    resized = stage == 3

    def cfg_for(workers: int, steps: int):
        return config(
            tmp_path,
            model={"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 32},
            data={"source": str(path), "shuffle": False, "seq_len": 32},
            batch={"global_batch_size": 16, "micro_batch_size": 2},
            optim={"momentum": 0.5},
            train={"strategy": "deepspeed", "max_steps": steps},
            deepspeed={"stage": stage, "offload_optimizer": offload},
            scaling={"num_workers": workers, "cpus_per_worker": 0.5},
            run={"name": "ds"},
            tracking={"enabled": False},
        )

    cfg = cfg_for(2, 2)
    if resized:
        fit_or_fail(cfg_for(2, 1))
        result = fit_or_fail(cfg_for(1, 2), resume=True)
        assert result.summary["resumed_from"] == 1
        assert result.history[-1]["scaling/grad_accum_steps"] == 8
    else:
        result = fit_or_fail(cfg)
    assert [r["train/samples"] for r in result.history] == [16, 6]
    assert [r["train/items"] for r in result.history] == [
        sum(len(s) - 1 for s in seqs[:16]),
        sum(len(s) - 1 for s in seqs[16:]),
    ]
    err, floor = sgd_step_errors(
        cfg,
        [padded_token_loss(seqs[:16]), padded_token_loss(seqs[16:])],
        load_model(result.checkpoint_dir),
        momentum=0.5,
    )
    record_equivalence(
        f"Ray Train, DeepSpeed ZeRO-{stage}, optimizer offload {offload}, GPT, padded tokens, "
        f"a full and a short window, 2 workers (vs float64; fp32 full batch: {floor:.3e})",
        err,
    )
    assert err <= max(2 * floor, 1e-5), (err, floor)
