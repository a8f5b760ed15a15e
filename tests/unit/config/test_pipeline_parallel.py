"""`train.pipeline_parallel`: what it composes with, each refusal naming its field, the value
and the fix; the batch arithmetic over the data-parallel ranks (a pipeline reads one share);
its other keys refused where there is no pipeline."""

from __future__ import annotations

import pytest

from rayacc.config import ConfigError, TrainConfig
from rayacc.config.strategies import strategies

GPT = {"name": "gpt", "n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 16}
BASE = {
    "model": GPT,
    "data": {"seq_len": 16},
    "batch": {"global_batch_size": 32, "micro_batch_size": 4},
    "train": {"strategy": "fsdp", "pipeline_parallel": 2},
    "scaling": {"num_workers": 4},
}


def with_(**sections) -> dict:
    out = {k: dict(v) for k, v in BASE.items()}
    for name, values in sections.items():
        out.setdefault(name, {}).update(values)
    return out


PP = {"strategy": "fsdp", "pipeline_parallel": 2}
REFUSED = [
    *[(with_(train={**PP, "strategy": s}), "train.pipeline_parallel",
       f"train.strategy={s}: {e.without_pipeline_parallel}")
      for s, e in strategies().items() if e.without_pipeline_parallel],
    (with_(train={**PP, "tensor_parallel": 2}, scaling={"num_workers": 6}),
     "train.pipeline_parallel", "× train.tensor_parallel=2 = 4 does not divide"),
    (with_(scaling={"num_workers": [2, 4]}), "train.pipeline_parallel", "elastic group"),
    (with_(scaling={"num_workers": 3}), "train.pipeline_parallel",
     "does not divide scaling.num_workers=3"),
    (with_(model={"name": "mlp"}), "train.pipeline_parallel",
     "model.name=mlp declares no split"),
    (with_(train={**PP, "pipeline_parallel": 4}, model={**GPT, "n_layer": 1}),
     "train.pipeline_parallel", "4 stages take one unit each of model.n_layer=1"),
    (with_(train={**PP, "pipeline_schedule": "zbv"}), "train.pipeline_schedule",
     "more ranks than pipeline stages"),
    (with_(train={**PP, "loss_chunk_tokens": 64}), "train.loss_chunk_tokens",
     "logits whole"),
    (with_(batch={"global_batch_size": 32, "micro_batch_size": "auto",
                  "memory_budget_mb": 512}), "batch.micro_batch_size", "one micro-batch"),
    (with_(fsdp={"replicate": 4}), "fsdp.replicate",
     "does not divide the data-parallel ranks (scaling.num_workers=4 / "
     "train.pipeline_parallel=2 = 2)"),
    (with_(batch={"global_batch_size": 32, "micro_batch_size": 4, "balance": "auto"}),
     "batch.balance", "moving rows between ranks may change them"),
    (with_(batch={"global_batch_size": 32, "micro_batch_size": 4,
                  "schedule": [{"from_samples": 64, "global_batch_size": 64}]}),
     "train.pipeline_parallel", "batch.schedule changes the accumulation"),
    *[(with_(train={"strategy": "fsdp", "pipeline_parallel": 1, key: value}), f"train.{key}",
       "applies to a pipeline only")
      for key, value in (("pipeline_schedule", "gpipe"), ("pipeline_stages_per_rank", 3))],
]  # fmt: skip


@pytest.mark.parametrize(("data", "field", "problem"), REFUSED, ids=[p for *_, p in REFUSED])
def test_what_a_pipeline_does_not_compose_with_is_refused_by_name(data, field, problem):
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict(data)
    found = [i for i in err.value.issues if i.path == field]
    assert found and any(problem in i.message for i in found), err.value
    assert all(i.fix for i in found)


def test_the_global_batch_splits_over_the_pipelines():
    cfg = TrainConfig.from_dict(with_())
    split = cfg.batch_split()
    assert (split.data_parallel, split.grad_accum_steps, split.model_parallel) == (2, 4, 2)
    assert split.describe() == ("global batch 32 = micro 4 × accum 4 × data-parallel ranks 2 "
                                "(4 workers in pipelines of 2 stages)")  # fmt: skip
    # 31 rows over the 2 data-parallel ranks: shares of 16 and 15, six micro-steps on each
    odd = TrainConfig.from_dict(with_(batch={"global_batch_size": 31, "micro_batch_size": 3}))
    split = odd.batch_split()
    assert (split.rank_shares, split.micro_batch_size, split.grad_accum_steps) == ((16, 15), 3, 6)
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict(with_(batch={"global_batch_size": 31, "grad_accum_steps": 3}))
    assert ("the data-parallel ranks (scaling.num_workers=4 / train.pipeline_parallel=2 = 2)"
            in str(err.value))  # fmt: skip


def test_a_pipeline_composes_with_tensor_parallelism_in_its_stages():
    both = with_(train={**PP, "tensor_parallel": 2}, scaling={"num_workers": 8})
    cfg = TrainConfig.from_dict(both)
    assert (cfg.mesh.pipeline, cfg.mesh.tensor, cfg.batch_split().data_parallel) == (2, 2, 2)
    assert cfg.batch_split().describe().endswith("(8 workers in groups of tensor 2 × pipeline 2)")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_every_schedule_is_taken_beside_data_parallel_ranks(schedule):
    cfg = TrainConfig.from_dict(with_(train={**PP, "pipeline_schedule": schedule}))
    assert cfg.train.pipeline_schedule == schedule
    one = TrainConfig.from_dict(with_(train={**PP, "pipeline_schedule": "zbv"},
                                      scaling={"num_workers": 2}))  # fmt: skip
    assert one.train.pipeline_schedule == "zbv"
