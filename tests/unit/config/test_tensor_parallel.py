"""`train.tensor_parallel`: what it composes with, each refusal naming the field, the value and
the fix; the batch arithmetic over the data-parallel ranks; a model without a plan, or heads
that do not divide, named before launch."""

from __future__ import annotations

import pytest

from rayacc.config import ConfigError, TrainConfig
from rayacc.config.strategies import strategies

GPT = {"name": "gpt", "n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 16}
BASE = {
    "model": GPT,
    "data": {"seq_len": 16},
    "batch": {"global_batch_size": 32, "micro_batch_size": 4},
    "train": {"strategy": "fsdp", "tensor_parallel": 2},
    "scaling": {"num_workers": 4},
}


def with_(**sections) -> dict:
    out = {k: dict(v) for k, v in BASE.items()}
    for name, values in sections.items():
        out.setdefault(name, {}).update(values)
    return out


REFUSED = [
    *[(with_(train={"strategy": s, "tensor_parallel": 2}),
       f"train.strategy={s}: {e.without_tensor_parallel}")
      for s, e in strategies().items() if e.without_tensor_parallel],
    (with_(scaling={"num_workers": [2, 4]}), "elastic group"),
    (with_(scaling={"num_workers": 6}, train={"strategy": "fsdp", "tensor_parallel": 4}),
     "does not divide scaling.num_workers=6"),
    (with_(model={**GPT, "n_head": 2}, train={"strategy": "fsdp", "tensor_parallel": 4}),
     "does not divide model.n_head=2"),
    (with_(model={"name": "mlp"}), "the mlp model declares no tensor-parallel plan"),
    *[(with_(scaling={"num_workers": 4, "placement_strategy": p}),
       f"scaling.placement_strategy={p} spreads over nodes") for p in ("SPREAD", "STRICT_SPREAD")],
]  # fmt: skip


@pytest.mark.parametrize(("data", "problem"), REFUSED, ids=[p for _, p in REFUSED])
def test_what_tensor_parallelism_does_not_compose_with_is_refused_by_name(data, problem):
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict(data)
    found = [i for i in err.value.issues if i.path == "train.tensor_parallel"]
    assert found and any(problem in i.message for i in found), err.value
    assert all(i.fix and i.value == data["train"]["tensor_parallel"] for i in found)


def test_hsdps_replica_groups_divide_the_data_parallel_ranks():
    assert TrainConfig.from_dict(with_(fsdp={"replicate": 2})).fsdp.replicate == 2
    assert TrainConfig.from_dict(with_(fsdp={"replicate": "auto"})).fsdp.replicate == "auto"
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict(with_(fsdp={"replicate": 4}))  # 4 workers, 2 data-parallel ranks
    (issue,) = [i for i in err.value.issues if i.path == "fsdp.replicate"]
    assert "the data-parallel ranks (scaling.num_workers=4 / train.tensor_parallel=2 = 2)" in (
        issue.message
    ), issue.message


def test_the_global_batch_splits_over_the_data_parallel_ranks():
    cfg = TrainConfig.from_dict(BASE)
    split = cfg.batch_split()
    # 4 workers in groups of 2: 2 data-parallel ranks, each a share of 16 rows; the workers
    # stay 4 wherever the split is read (the console, MLflow's num_workers, per-device FLOPs)
    assert (split.num_workers, split.data_parallel, split.grad_accum_steps) == (4, 2, 4)
    assert split.global_batch_size == 32 == split.micro_batch_size * 4 * split.data_parallel
    assert split.describe() == (
        "global batch 32 = micro 4 × accum 4 × data-parallel ranks 2 (4 workers in "
        "tensor-parallel groups of 2)"
    )
    plain = TrainConfig.from_dict(with_(train={"strategy": "fsdp", "tensor_parallel": 1}))
    assert (plain.batch_split().num_workers, plain.batch_split().data_parallel) == (4, 4)
    assert plain.batch_split().describe().endswith("× workers 4")


def test_a_batch_that_does_not_split_names_the_data_parallel_ranks():
    # 33 over the 2 data-parallel ranks is 17 + 16 where the accumulation is derived
    odd = TrainConfig.from_dict(with_(batch={"global_batch_size": 33, "micro_batch_size": 3}))
    assert odd.batch_split().rank_shares == (17, 16)
    with pytest.raises(ConfigError) as err:
        TrainConfig.from_dict(with_(batch={"global_batch_size": 33, "grad_accum_steps": 3}))
    (issue,) = [i for i in err.value.issues if i.path == "batch.global_batch_size"]
    assert "the data-parallel ranks (scaling.num_workers=4 / train.tensor_parallel=2 = 2)" in (
        issue.message
    ), issue.message
    assert "groups of 2 divide 33" in issue.fix, issue.fix


def test_the_record_counts_the_workers_and_each_ones_share_of_the_flops():
    from rayacc.engine.result import StepResult
    from rayacc.tracking.params import contract_params
    from rayacc.worker.metrics import step_record

    cfg = TrainConfig.from_dict(BASE)
    split = cfg.batch_split()
    params = contract_params(cfg, split, 0.1)
    assert (params["num_workers"], params["data_parallel_size"]) == (4, 2)
    result = StepResult(
        loss=1.0, items=32, samples=32, micro_steps=4, grad_norm=0.5, lr=0.1, skipped=False,
        skip_reason=None, allreduce_calls=0, reduce_scatter_calls=0, sync_passes=4,
        step_time_s=1.0, sync_time_s=0.0, peak_memory_mb=1.0,
    )  # fmt: skip
    record = step_record(
        result, step=1, epoch=0, wall_s=1.0, data_s=0.0, split=split, micro_now=4,
        accum_now=4, skipped_steps=0, rows_read=32, rss_mb=1.0, flops_per_item=1e12,
        peak_tflops=None, token_items=True,
    )  # fmt: skip
    assert (record["scaling/num_workers"], record["scaling/data_parallel_size"]) == (4, 2)
    # 32 items × 1 TFLOP in 1 s over 4 devices (each tensor-parallel rank does half its
    # group's share), not over the 2 groups
    assert record["perf/tflops"] == 8.0
    plain = TrainConfig.from_dict(with_(train={"strategy": "fsdp", "tensor_parallel": 1}))
    assert "data_parallel_size" not in contract_params(plain, plain.batch_split(), 0.1)


def test_a_model_without_a_plan_or_heads_that_do_not_divide_are_named_before_launch(tmp_path):
    from rayacc.driver.prelaunch import prepare
    from rayacc.models import ModelError
    from tests.support.data.tokens import token_data
    from tests.support.models.hf_configs import tiny_llama

    info = token_data(tmp_path, "ids")
    base = with_(data={"source": info.path, "seq_len": 8})
    llama = tiny_llama(info.vocab_size)  # 2 heads, 1 key/value head
    with pytest.raises(ModelError, match="does not divide the model's num_key_value_heads=1"):
        prepare(TrainConfig.from_dict({**base, "model": {"name": "hf", "hf": {"config": llama}}}))
    factory = {"name": "factory", "factory": "tests.support.models.oom_model:build",
               "kwargs": {"threshold": 1000}}  # fmt: skip
    with pytest.raises(ModelError, match="declares no tensor-parallel plan"):
        prepare(TrainConfig.from_dict({**base, "model": factory}))


def test_the_memory_estimate_covers_tensor_parallelism(tmp_path, capsys):
    """`plan --memory` under TP: the configured strategy's rows, each rank holding its share
    of the model (what the plan splits, over T) sharded over the data-parallel ranks — the
    planner's `TensorPlan.keep`, checked against a real mesh's shards in
    `distributed/test_tensor_parallel.py`."""
    import yaml

    from rayacc.cli import main
    from rayacc.driver.prelaunch import prepare
    from rayacc.models import build_on_meta
    from rayacc.planner.search import tensor_plan

    spec = with_(data={"source": "shakespeare", "seq_len": 16})
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec))
    assert main(["plan", "-c", str(job)]) == 0
    assert "× data-parallel ranks 2 (4 workers" in capsys.readouterr().out
    assert main(["plan", "-c", str(job), "--memory"]) == 0
    out = capsys.readouterr().out
    cfg = TrainConfig.from_dict(spec)
    prep = prepare(cfg)
    keep = tensor_plan(build_on_meta(cfg, prep.info), 1, 4).keep(2)
    assert 0.5 < keep < 1 and f"each rank {keep:.0%} of the model" in out, out
    rows = {line.split()[1]: line.split() for line in out.splitlines() if "× tp 2" in line}
    assert set(rows) == {"every_micro_step", "window_end"}, out  # fsdp's rows only
    shard = prep.num_parameters * keep / 2 * 4 / 2**20
    assert float(rows["every_micro_step"][5]) == pytest.approx(shard, abs=0.05), out


def test_the_memory_estimate_shards_over_the_shard_group_under_hsdp():
    """`fsdp.replicate`: the state is sharded inside each replica group, so a rank holds
    1 / (workers / replicate) of it (it was counted over every worker)."""
    from rayacc.data.bundled import prepare_bundled
    from rayacc.data.sources import read_source
    from rayacc.run.quantities import memory_per_rank

    info = read_source(str(prepare_bundled("digits"))).info
    rows = {}
    for replicate in (1, 2):
        cfg = TrainConfig.from_dict(
            {
                "model": {"name": "mlp"},
                "batch": {"global_batch_size": 32, "micro_batch_size": 4},
                "train": {"strategy": "fsdp"},
                "fsdp": {"replicate": replicate},
                "scaling": {"num_workers": 4},
            }
        )
        rows[replicate] = {r[0]: r for r in memory_per_rank(cfg, info, 4 * 2**18, 4)}
    one, two = rows[1]["fsdp every_micro_step"], rows[2]["fsdp every_micro_step"]
    assert one[1] == 1.0 and two[1] == 2.0  # MiB of a 4 MiB model: a quarter, then a half
    assert rows[1]["ddp"] == rows[2]["ddp"]
