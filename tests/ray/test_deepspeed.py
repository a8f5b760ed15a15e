"""train.strategy=deepspeed through the whole stack on the suite's Ray: Ray Train workers run
DeepSpeed's engine at each ZeRO stage, with optimizer offload on and off, over a full window
and a short last one, and the steps equal the single-process full-batch steps; the model loads
from DeepSpeed's checkpoint files without DeepSpeed's runtime."""

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
"""(ZeRO stage, optimizer offload): each stage, offload on and off, one worker group each (the
other three of the six run on 2 gloo ranks: tests/distributed/test_deepspeed.py)."""


@pytest.mark.parametrize("stage, offload", CASES, ids=[f"zero{s}-offload_{o}" for s, o in CASES])
def test_each_stage_through_the_whole_stack_equals_the_full_batch_steps(
    ray_local, tmp_path, record_equivalence, stage, offload
):
    """22 token rows of 2 to 20 tokens (shortest first), global batch 16 on 2 workers × micro
    2: a full window (4 micro-steps per rank), then a short last one of 6 rows (2 per rank,
    the second of one row); the GPT's embedding and head are one tied weight."""
    rng = np.random.default_rng(stage)
    seqs = sorted((rng.integers(0, 17, rng.integers(2, 21)).tolist() for _ in range(22)), key=len)
    path = tmp_path / "tokens.parquet"
    pq.write_table(pa.table({"tokens": pa.array(seqs, pa.list_(pa.uint16()))}), path)
    cfg = config(
        tmp_path,
        model={"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 32},
        data={"source": str(path), "shuffle": False, "seq_len": 32},
        batch={"global_batch_size": 16, "micro_batch_size": 2},
        train={"strategy": "deepspeed", "max_steps": 2},
        deepspeed={"stage": stage, "offload_optimizer": offload},
        tracking={"enabled": False},
    )
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
    )
    record_equivalence(
        f"Ray Train, DeepSpeed ZeRO-{stage}, optimizer offload {offload}, GPT, padded tokens, "
        f"a full and a short window, 2 workers (vs float64; fp32 full batch: {floor:.3e})",
        err,
    )
    assert err <= max(2 * floor, 1e-5), (err, floor)
