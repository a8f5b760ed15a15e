"""train.strategy=deepspeed through the whole stack on the suite's Ray: Ray Train workers run
DeepSpeed's engine at each ZeRO stage, with optimizer offload on and off, fine-tuning LoRA
adapters on instruction rows whose loss mask counts unevenly, over a full window and a short
last one, and the steps equal the single-process full-batch steps; the model loads from
DeepSpeed's checkpoint files (the adapters: the frozen base is not in them) without DeepSpeed's
runtime, and its adapter loads in peft with equal logits."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayacc import load_model
from rayacc.data.common import DataError
from rayacc.driver.fit import fit
from tests.support.models.hf_configs import tiny_llama
from tests.support.services.fits import (
    config,
    fit_or_fail,
    padded_token_loss,
    sgd_step_errors,
)

pytestmark = pytest.mark.ray
pytest.importorskip("deepspeed")

LLAMA = tiny_llama(vocab_size=32, max_positions=64)
"""A tiny `transformers` Llama (its embedding and head one tied weight), built from this
config in the test (nothing fetched)."""
MODEL = {
    1: {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 32},
    2: {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 32},
    # ZeRO-3 with a Hugging Face model: the tuning guides' own case
    3: {"name": "hf", "hf": {"config": LLAMA}},
}
ALL_CASES = [(1, "none"), (1, "cpu"), (2, "none"), (2, "cpu"), (3, "none"), (3, "cpu")]
"""(ZeRO stage, optimizer offload)."""
CASES = ALL_CASES if os.environ.get("RAYACC_TEST_ALL_STAGES") else [(3, "cpu")]
"""What the suite runs: ZeRO-3 with its optimizer offloaded, the stage with the most moving
parts, in one worker group (each costs about 25 s of the suite's time); the six cases with
RAYACC_TEST_ALL_STAGES=1. Every case runs on 2 gloo ranks in the suite
(tests/distributed/test_deepspeed.py, with the resume at the same and another rank count)."""


@pytest.mark.parametrize("stage, offload", CASES, ids=[f"zero{s}-offload_{o}" for s, o in CASES])
def test_each_stage_through_the_whole_stack_equals_the_full_batch_steps(
    ray_local, tmp_path, record_equivalence, stage, offload
):
    """22 token rows of 2 to 20 tokens (shortest first), each with a loss mask counting an
    answer of 1 token up to the whole row, global batch 16 on 2 workers × micro 2: a full
    window (4 micro-steps per rank), then a short last one of 6 rows (2 per rank, the second
    of one row); LoRA adapters on a frozen base whose embedding and head are one tied weight
    (rayacc's GPT, or under ZeRO-3 a `transformers` Llama, whose adapter then loads in peft,
    and merged in transformers, with equal logits); SGD with momentum. Under ZeRO-3 a resume
    of the run on 1 worker is then refused before anything starts: DeepSpeed's universal
    checkpoint, its way to another worker count, carries Adam's state only."""
    rng = np.random.default_rng(stage)
    seqs = sorted((rng.integers(0, 17, rng.integers(2, 21)).tolist() for _ in range(22)), key=len)
    answers = [1 if i % 3 == 0 else int(rng.integers(1, len(s) + 1)) for i, s in enumerate(seqs)]
    masks = [[0] * (len(s) - a) + [1] * a for s, a in zip(seqs, answers, strict=True)]
    path = tmp_path / "tokens.parquet"
    table = {
        "tokens": pa.array(seqs, pa.list_(pa.uint16())),
        "loss_mask": pa.array(masks, pa.list_(pa.uint8())),
    }
    pq.write_table(pa.table(table), path)

    def cfg_for(workers: int, steps: int):
        return config(
            tmp_path,
            model={**MODEL[stage], "lora": {"r": 4, "alpha": 8}},
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
    result = fit_or_fail(cfg)
    if (stage, offload) == CASES[-1]:
        with pytest.raises(DataError, match="written by 2 workers, this config starts 1"):
            fit(cfg_for(1, 3), resume=True)
    assert [r["train/samples"] for r in result.history] == [16, 6]
    # the counted targets (a row's first token is never a target)
    assert [r["train/items"] for r in result.history] == [
        sum(sum(m[1:]) for m in masks[:16]),
        sum(sum(m[1:]) for m in masks[16:]),
    ]
    err, floor = sgd_step_errors(
        cfg,
        [padded_token_loss(seqs[:16], masks[:16]), padded_token_loss(seqs[16:], masks[16:])],
        load_model(result.checkpoint_dir),
        momentum=0.5,
    )
    record_equivalence(
        f"Ray Train, DeepSpeed ZeRO-{stage}, optimizer offload {offload}, LoRA on "
        f"{'a transformers Llama' if stage == 3 else 'GPT'}, masked tokens, a full and a short "
        f"window, 2 workers (vs float64; fp32 full batch: {floor:.3e})",
        err,
    )
    assert err <= max(2 * floor, 1e-5), (err, floor)
    if stage == 3:
        # the adapters out to peft, on the base built as the run built it: load_model's logits
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        from rayacc import build_model
        from rayacc.driver.export import export_model

        x = torch.tensor([seqs[-1]])
        with torch.no_grad():
            ours = load_model(result.checkpoint_dir)(x)
        export_model(result.checkpoint_dir, str(tmp_path / "adapter"), fmt="peft")
        plain = cfg.model_copy(update={"model": cfg.model.model_copy(update={"lora": None})})
        base = build_model(plain).hf
        theirs = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        with torch.no_grad():
            assert torch.allclose(theirs(input_ids=x).logits, ours, atol=1e-6)
        export_model(result.checkpoint_dir, str(tmp_path / "merged"), fmt="peft", merge=True)
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
        with torch.no_grad():
            assert torch.allclose(merged(input_ids=x).logits, ours, atol=1e-5)
