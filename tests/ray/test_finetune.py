"""The fine-tuner's job as the command a user runs (`rayacc train`, on a Ray it starts itself):
jobs/finetune_chat.yaml (the bundled chat sample, its loss counting the assistant turns, LoRA
adapters on a GPT sharded by FSDP2 over 2 workers) trains; each step's loss items are its rows'
counted tokens; MLflow records the mask rule, the adapters and what trains; the checkpoint keeps
the adapters, not the frozen base; the adapter `rayacc export --format peft` writes loads with
`AutoPeftModelForCausalLM` on the GPT-2 beside it with the logits rayacc's own reader gives, and
`--merge` writes a transformers folder with them; `rayacc sample` reads the run. (ZeRO-3 with
adapters: tests/ray/test_deepspeed.py.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from mlflow.tracking import MlflowClient

from rayacc import TrainConfig, build_model, load_model
from rayacc.driver.export import export_model
from rayacc.driver.sample import sample
from tests.support.services.cli import assert_only_rayaccs_lines, rayacc_process

pytestmark = pytest.mark.ray
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[2]


def test_the_chat_job_trains_adapters_under_fsdp_and_exports_them_for_peft(tmp_path):
    proc = rayacc_process(
        [
            "train",
            "-c",
            str(ROOT / "jobs/finetune_chat.yaml"),
            "train.max_steps=3",
            "train.val_every_steps=null",
            "train.checkpoint_every_steps=null",
            "data.shuffle=false",
            "data.val_fraction=0",
            "run.name=chat",
        ],
        cwd=tmp_path,
        timeout=400,
        RAYACC_CACHE=str(tmp_path / "cache"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_only_rayaccs_lines(proc)
    assert "strategy FSDP2" in proc.stdout and "LoRA r=8 on qkv, proj, mlp.0, mlp.2, head" in (
        proc.stdout
    )
    cfg = TrainConfig.from_yaml(ROOT / "jobs/finetune_chat.yaml")
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name(cfg.tracking.experiment).experiment_id
    (run,) = client.search_runs([experiment])
    items = client.get_metric_history(run.info.run_id, "train/items")
    history = [int(m.value) for m in sorted(items, key=lambda m: m.step)]
    checkpoint = max((tmp_path / "rayacc_runs" / "chat").glob("checkpoint_step*"))

    # the loss's items are the counted tokens of each step's 32 rows (the data in order)
    (source,) = (tmp_path / "cache" / "chat").glob("chat_seq*.parquet")
    masks = pq.read_table(source, columns=["loss_mask"])["loss_mask"].to_pylist()
    counted = [sum(sum(m[1:]) for m in masks[32 * s : 32 * (s + 1)]) for s in range(3)]
    tokens = [sum(len(m) - 1 for m in masks[32 * s : 32 * (s + 1)]) for s in range(3)]
    assert history == counted
    assert all(c < t / 2 for c, t in zip(counted, tokens, strict=True)), (counted, tokens)

    assert run.data.tags["rayacc.mask_rule"] == "answers"
    trainable, total = map(int, run.data.tags["rayacc.trainable_parameters"].split(" of "))
    assert 0 < trainable < total / 10
    assert run.data.tags["rayacc.base"] == f"gpt built from seed {cfg.seed}"
    assert run.data.params["model.lora.r"] == "8"

    # the frozen base is not in the checkpoint: DCP's index names adapters (and buffers) only
    from torch.distributed.checkpoint import FileSystemReader

    index = FileSystemReader(str(checkpoint / "shards")).read_metadata()
    model_keys = [k for k in index.state_dict_metadata if k.startswith("model.")]
    assert model_keys and not [k for k in model_keys if "base_layer" in k or "tok." in k]
    assert any(".lora_A." in k for k in model_keys), model_keys

    ours = load_model(str(checkpoint))
    x = torch.arange(40).reshape(1, 40)
    with torch.no_grad():
        expected = ours(x)
    from peft import AutoPeftModelForCausalLM

    export_model(str(checkpoint), str(tmp_path / "adapter"), fmt="peft")
    base_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"lora": None})})
    base = build_model(base_cfg, _info(source))
    with torch.no_grad():
        assert not torch.allclose(base(x), expected, atol=1e-4), "the adapters changed it"
    # the adapter names the GPT-2 written beside it as its base: peft loads the run alone
    theirs = AutoPeftModelForCausalLM.from_pretrained(str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        assert torch.allclose(theirs(input_ids=x).logits, expected, atol=1e-5)

    from transformers import AutoModelForCausalLM

    export_model(str(checkpoint), str(tmp_path / "merged"), fmt="peft", merge=True)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=x).logits, expected, atol=1e-5)

    text = sample(str(checkpoint), prompt="<|user|>Hi<|end|><|assistant|>", tokens=8)
    assert len(text.ids) == 8


def _info(source: Path):
    from rayacc.data.sources import describe_dataset

    info = describe_dataset(str(source))
    assert info.loss_mask and np.isfinite(info.num_rows)
    return info
