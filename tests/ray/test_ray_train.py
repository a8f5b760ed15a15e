"""The main job on a real local Ray with a real MLflow store: no mocks of either."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from mlflow.tracking import MlflowClient

from rayacc import TrainConfig, build_model, load_model
from rayacc.data.bundled import prepare_bundled
from rayacc.observe.console import ProgressPrinter
from rayacc.observe.events import RunObserver
from tests.support.services.fits import (
    config,
    digits_subset,
    fit_or_fail,
    padded_token_loss,
    padded_token_rows,
    rel_diff,
    sgd_step_errors,
    weights,
)

pytestmark = pytest.mark.ray


def test_end_to_end_fit_records_contract_params_and_every_step(ray_local, tmp_path, monkeypatch):
    # data.in_process_read_max_mb=0: the ranks' Ray Data read tasks (even for small data) run
    # on any node, so the bundled dataset (prepared in the driver node's cache) is staged under
    # run.storage_path first. The store and experiment as MLflow's users name them: its
    # variables, the config's fields null
    store = f"sqlite:///{tmp_path / 'env-mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-the-environment")
    cfg = config(
        tmp_path,
        data={"val_fraction": 0.2, "in_process_read_max_mb": 0},
        batch={"global_batch_size": 64, "micro_batch_size": 8},
        optim={
            "name": "adamw",
            "lr": 0.002,
            "base_batch_size": 32,
            "lr_scaling": "sqrt",
            "warmup_steps": 2,
            "schedule": "cosine",
        },
        train={"max_steps": 8, "val_every_steps": 4, "checkpoint_every_steps": 4},
        tracking={"system_metrics": True, "tracking_uri": None, "experiment": None},
    )
    result = fit_or_fail(cfg)

    assert result.tracking_uri == store
    client = MlflowClient(store)
    run = client.get_run(result.mlflow_run_id)
    assert client.get_experiment(run.info.experiment_id).name == "from-the-environment"
    p = run.data.params
    micro, accum, workers, glob = (
        int(p[k])
        for k in ("micro_batch_size", "grad_accum_steps", "num_workers", "global_batch_size")
    )
    assert (micro, accum, workers, glob) == (8, 4, 2, 64)
    assert glob == micro * accum * workers
    assert float(p["effective_lr"]) == pytest.approx(0.002 * (64 / 32) ** 0.5)
    assert (p["lr_scaling"], float(p["base_lr"]), int(p["base_batch_size"])) == ("sqrt", 0.002, 32)
    assert p["optim.warmup_steps"] == "2"  # the whole config, flattened
    assert run.info.status == "FINISHED"

    for key in (
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/items",
        "train/samples_per_s",
        "comm/allreduce_calls",
        "comm/sync_time_frac",
        "mem/peak_mb",
    ):
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert sorted(steps) == list(range(1, 9)), key
    calls = {m.value for m in client.get_metric_history(run.info.run_id, "comm/allreduce_calls")}
    assert calls == {1.0}, "one gradient all-reduce per optimizer step (4 micro-steps, 1 bucket)"
    lrs = [
        m.value
        for m in sorted(
            client.get_metric_history(run.info.run_id, "train/lr"), key=lambda m: m.step
        )
    ]
    assert lrs[0] == pytest.approx(float(p["effective_lr"]) / 2)  # warmup step 1 of 2
    val = client.get_metric_history(run.info.run_id, "val/accuracy")
    assert sorted(m.step for m in val) == [4, 8]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "loss_curve.png"} <= artifacts
    assert result.checkpoint_dir and load_model(result.checkpoint_dir) is not None
    assert (tmp_path / "runs" / "_data" / "digits.parquet").is_file()

    # every second of the wall time in a category; those this run has are not empty
    from rayacc.observe.goodput import PARTS

    g = result.goodput
    assert sum(g[k] for k in PARTS) == pytest.approx(g["wall_s"])
    for key in ("training_s", "startup_s", "group_start_s", "validation_s", "checkpoint_s"):
        assert g[key] > 0, (key, g)
    assert g["restore_s"] == 0 and g["recomputed_s"] == 0 and g["restarts_s"] == 0, g
    assert run.data.metrics["goodput/validation_s"] == pytest.approx(g["validation_s"])

    # tracking.system_metrics: MLflow's system metrics of the one node, with every rank's
    # figures, each interval (a tenth of 8 steps: every step; step 1's arrive with step 2)
    from rayacc.worker.system import NAMES

    system = sorted(k for k in run.data.metrics if k.startswith("system/"))
    nodes = {k.split("/")[1] for k in system}
    assert len(nodes) == 1 and len(system) == len(NAMES), system
    (node,) = nodes
    for key in (f"system/{node}/cpu_utilization_percentage", "rank_0/own_s", "rank_1/sync_s"):
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert steps == list(range(2, 9)), (key, steps)
    memory = client.get_metric_history(
        run.info.run_id, f"system/{node}/system_memory_usage_megabytes"
    )
    assert all(m.value > 0 for m in memory)


def test_whole_stack_steps_equal_full_batch_through_a_batch_schedule_and_balance(
    ray_local, tmp_path, record_equivalence, capfd
):
    """Twelve steps through the whole stack against float64 full-batch steps: 2 workers ×
    micro 4 × accumulation 4, then `batch.schedule` doubles the global batch at sample 32
    (accumulation 8; the LR by its linear rule over the re-warmup: 0.1, then 0.12 … 0.2);
    rank 1 sleeps 10 ms a row, and `batch.balance: auto` moves rows to rank 0 — its share
    falls and its compute in a window (what the step waits on) with it, the weights
    unchanged. (One worker's windows are the combination matrix's 1-worker cases; a change of
    worker count, the elastic test's.)"""
    source = digits_subset(tmp_path / "d736.parquet", 32 + 11 * 64)
    cfg = config(
        tmp_path,
        # read through Ray Data's tasks: each move re-plans a rank's stream of row groups
        data={"source": source, "shuffle": False, "in_process_read_max_mb": 0},
        model={
            "name": "factory",
            "factory": "tests.support.models.slow_model:build",
            "kwargs": {"delay_s": 0.0, "row_delay_s": 0.01, "slow_rank": 1},
        },
        batch={"schedule": [{"from_samples": 32, "global_batch_size": 64}], "balance": "auto"},
        train={"max_steps": 12},
        tracking={"enabled": False},
    )
    records: list[dict] = []

    class Records(RunObserver):
        def on_step(self, record):
            records.append(dict(record))

    result = fit_or_fail(cfg, observers=[ProgressPrinter(), Records()])
    out = capfd.readouterr().out
    assert (
        "batch schedule at step 1 (sample 32): global batch 32 → 64, accumulation 4 → 8, "
        "effective LR 0.2"
    ) in out, out
    moves = re.findall(r"shares at step (\d+): 32 \+ 32 → (\d+) \+ (\d+) rows \(rank 1: ", out)
    assert moves and int(moves[0][2]) < 32 < int(moves[0][1]), out
    # rank 1's compute per window (its means over each logging interval of 2 steps) is what
    # the step waits on, and its sleeps make it ∝ its rows: it falls with its share. (The
    # box's samples/s also counts the read tasks, and on a shared 2-core box other work's.)
    moved_at, rows = int(moves[0][0]), int(moves[0][2])
    compute = {r["step"]: r["rank_1/compute_s"] for r in records if "rank_1/compute_s" in r}
    # figures arrive one window late: an interval ending at step k measured windows k-2, k-1
    # (window 1 is the first phase's 16 rows a rank)
    before = [t for k, t in compute.items() if k - 2 >= 2 and k <= moved_at]
    after = [t for k, t in compute.items() if k - 2 >= moved_at + 1]
    assert before and after, compute
    assert max(after) < min(before), (before, after)
    assert statistics.median(after) < (rows + 4) / 32 * statistics.median(before), (before, after)
    every = re.findall(r"shares at step \d+: [\d +]+→ [\d +]+rows", out)
    print(f"balanced: {every}; rank 1's compute s per window before {before}, after {after}")

    table = pq.read_table(cfg.data.source)
    features = np.stack(table["features"].to_numpy(zero_copy_only=False))
    labels = torch.tensor(table["label"].to_numpy())

    def window(lo: int, hi: int, lr_factor: float):
        def loss(model, dtype):
            x = torch.tensor(features[lo:hi], dtype=dtype)
            return lr_factor * F.cross_entropy(model(x), labels[lo:hi])

        return loss

    # step k ≥ 2 runs at 0.1 × (1 + min(k − 2, 5) / 5): the ramp to the phase's 0.2
    windows = [window(0, 32, 1.0)] + [
        window(32 + 64 * (k - 2), 32 + 64 * (k - 1), 1 + min(k - 2, 5) / 5) for k in range(2, 13)
    ]
    trained = load_model(result.checkpoint_dir, factory=cfg.model.factory)
    err, floor = sgd_step_errors(cfg, windows, trained)
    record_equivalence(
        f"Ray Train, 2 workers, global batch 32 → 64 by batch.schedule, shares balanced "
        f"(vs float64; fp32 full batch: {floor:.3e})",
        err,
    )
    assert err <= 2 * floor, (err, floor)


def test_two_runs_of_one_config_give_the_same_weights_through_either_read_path(
    ray_local, tmp_path, capfd
):
    """Two runs of one model — shuffled epochs, SGD momentum, dropout, 203 rows (uneven: each
    epoch ends on a short window of 11, 6 and 5 rows on the two ranks) — end with identical
    weights, although one reads its rows through Ray Data's read tasks and the other in its own
    processes: the exact order is the same rows in the same windows either way, and dropout
    draws the same masks. The first run's tracking server cannot be reached (nothing listens on
    port 9): tracking turns off with one message and training goes on. In the second, rank 1's
    forwards each take 0.1 s more (timing only: the math is the same): it is named the
    straggler, in compute, on the console and in MLflow within two logging intervals, with
    every rank's figures logged; the first, even run names none."""
    source = digits_subset(tmp_path / "d203.parquet", 203)

    def run(name: str, in_process_read_max_mb: float, tracking: dict, **slow):
        return fit_or_fail(
            config(
                tmp_path / name,
                model={
                    "name": "factory",
                    "factory": "tests.support.models.slow_model:build",
                    "kwargs": {"dropout": 0.1, "delay_s": 0.0, **slow},
                },
                data={
                    "source": source,
                    "shuffle": True,
                    "in_process_read_max_mb": in_process_read_max_mb,
                },
                optim={"momentum": 0.9},
                train={"epochs": 2, "max_steps": None},
                tracking=tracking,
            ),
            observers=[ProgressPrinter()],  # the console of `rayacc train`
        )

    ray_data = run("ray-data", 0, {"tracking_uri": "http://127.0.0.1:9"})
    out, err = capfd.readouterr()
    assert err.count("tracking off, training goes on") == 1, err
    assert ray_data.mlflow_run_id is None
    assert "straggler" not in out + err, "an even run names no straggler"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    in_process = run(
        "in-process", 16, {"tracking_uri": uri, "experiment": "ranks"}, delay_s=0.1, slow_rank=1
    )
    out, _ = capfd.readouterr()
    for result in (ray_data, in_process):
        assert [r["train/samples"] for r in result.history] == [32] * 6 + [11] + [32] * 6 + [11]
        assert result.summary["train_state"]["samples_seen"] == 2 * 203
        assert result.summary["train_state"]["optimizer_step"] == 14
    factory = "tests.support.models.slow_model:build"
    wa, wb = (weights(load_model(r.checkpoint_dir, factory)) for r in (ray_data, in_process))
    assert torch.equal(wa, wb), "two runs of one config must give identical weights"
    # the run's logged model as MLflow's own loader reads it: the checkpoint's model
    import mlflow.pytorch

    (output,) = MlflowClient(uri).get_run(in_process.mlflow_run_id).outputs.model_outputs
    with mlflow.tracking._tracking_service.utils._use_tracking_uri(uri):
        logged = mlflow.pytorch.load_model(f"models:/{output.model_id}")
    x = torch.randn(3, 64)
    assert torch.equal(logged(x), load_model(in_process.checkpoint_dir, factory)(x))

    # 14 steps: a logging interval is 2; rank 1 is slow from its first window, whose figures
    # arrive with step 2, so it is named at the end of the second interval, step 4
    (line,) = [x for x in out.splitlines() if "straggler" in x]
    assert "straggler at step 4: rank 1 on node " in line and "slow in compute" in line, line
    client = MlflowClient(uri)
    run_ = client.get_run(in_process.mlflow_run_id)
    assert run_.data.tags["rayacc.stragglers"].startswith("step 4: rank 1 on node "), run_
    assert "compute" in run_.data.tags["rayacc.stragglers"]
    history = {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run_.info.run_id, key))
        for key in ("rank_0/own_s", "rank_1/own_s", "rank_1/compute_s", "ranks/slowest")
    }
    assert [step for step, _ in history["rank_1/own_s"]] == list(range(2, 15, 2))
    assert all(
        slow > fast + 0.15  # 0.4 s a window (0.2 s in the short ones)
        for (_, slow), (_, fast) in zip(history["rank_1/own_s"], history["rank_0/own_s"])
    ), history
    assert [step for step, _ in history["ranks/slowest"]] == list(range(2, 15))
    assert {v for _, v in history["ranks/slowest"]} == {1.0}
    # judged on the driver: the fit's records hold the judgement, the checkpoints' lineage
    # (rank 0's records) neither it nor the figures it was made from
    assert in_process.history[3]["ranks/slowest"] == 1.0
    kept = (Path(in_process.checkpoint_dir) / "history.jsonl").read_text().splitlines()
    assert len(kept) == 14
    assert not [k for line in kept for k in json.loads(line) if k.startswith(("rank", "_rank"))]


def test_a_size_that_ran_out_of_memory_in_training_is_not_chosen_again(ray_local, tmp_path):
    """Out of memory in a window's last micro-step cannot be retried in place (the peers
    already wait in the gradient all-reduce): the group restarts, and its auto search stays
    below every size that failed. Micro 32 and then 16 fail here; 8 trains. The groups that
    ended leave nothing in the temp folder."""
    import tempfile

    def ours() -> set[str]:
        # (cluster/local.sh's Ray temp folders, `rayacc-local-PORT`, are the multi-node tests'
        # on the other worker, made whenever their clusters start)
        temp = Path(tempfile.gettempdir())
        return {p.name for p in temp.glob("rayacc-*") if not p.name.startswith("rayacc-local-")}

    before = ours()
    cfg = config(
        tmp_path,
        model={
            "name": "factory",
            "factory": "tests.support.models.oom_model:build",
            "kwargs": {"threshold": 16},
        },
        batch={"global_batch_size": 64, "micro_batch_size": "auto", "memory_budget_mb": 4096},
        train={"max_steps": 2},
        run={"max_failures": 3},
        tracking={"enabled": False},
    )
    result = fit_or_fail(cfg)
    assert [r["scaling/micro_batch_size"] for r in result.history] == [8, 8]
    assert result.summary["split"]["micro_batch_size"] == 8
    from rayacc.checkpoint.upload import STAGING_PREFIX, stale_staging

    new = ours() - before
    # the temp folder is the other xdist worker's too: a staging folder whose process lives is
    # its checkpoint in flight (seen once, gone a moment later); one whose process is gone is
    # a leak, this run's or not
    stale = {p.name for p in stale_staging()}
    in_flight = {n for n in new if n.startswith(STAGING_PREFIX) and n not in stale}
    assert new - in_flight == set(), (new, in_flight)


def test_a_sharded_search_trial_out_of_memory_restarts_the_group_below_it(ray_local, tmp_path):
    """Under FSDP a search trial that runs out of memory is not retried in place (the peers may
    wait in its collectives): the group fails after recording the size, restarts, and its
    search stays below. Of 1..32 per worker the search tries 4, then 16 (out of memory); after
    the restart 2, 4 and 8, and 8 trains."""
    cfg = config(
        tmp_path,
        model={
            "name": "factory",
            "factory": "tests.support.models.oom_model:build",
            "kwargs": {"threshold": 16, "always": True},
        },
        batch={"global_batch_size": 64, "micro_batch_size": "auto", "memory_budget_mb": 4096},
        train={"max_steps": 2, "strategy": "fsdp"},
        run={"max_failures": 2},
        tracking={"enabled": False},
    )
    result = fit_or_fail(cfg)
    assert [r["scaling/micro_batch_size"] for r in result.history] == [8, 8]


@pytest.mark.parametrize(
    ("grad_sync", "recompute", "chunk", "compile_", "micro", "tp", "pp"),
    [
        ("every_micro_step", "none", None, True, 2, 1, 2),
        ("window_end", "full", 8, False, "auto", 2, 1),
    ],
)
def test_fsdp_on_padded_token_rows_equals_full_batch(
    ray_local, tmp_path, record_equivalence, grad_sync, recompute, chunk, compile_, micro, tp, pp
):
    """train.strategy=fsdp through the whole stack: Ray workers shard the GPT with FSDP2,
    accumulate in either sync mode (with activation checkpointing, the chunked loss, which
    runs inside the sharded forward, and the auto micro-batch search, whose trials run without
    sync, in one; that one also splits each layer over 2 ranks, 2 data-parallel × 2
    tensor-parallel workers; the other cuts the GPT into 2 pipeline stages, 2 × 2 workers, its
    compiled blocks under the 1F1B schedule), and the step equals the full batch in one
    process; the model loads whole from the sharded checkpoint. The reduce-scatters are counted
    and timed."""
    path = tmp_path / "tokens.parquet"
    seqs = padded_token_rows(path, seed=1, dtype=pa.uint16())
    cfg = config(
        tmp_path,
        model={"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 32},
        data={"source": str(path), "shuffle": False, "seq_len": 32},
        batch={
            "global_batch_size": 16,
            "micro_batch_size": micro,
            **({"memory_budget_mb": 4096} if micro == "auto" else {}),
        },
        train={
            "strategy": "fsdp",
            "activation_checkpointing": recompute,
            "loss_chunk_tokens": chunk,
            "compile": compile_,
            "tensor_parallel": tp,
            "pipeline_parallel": pp,
        },
        fsdp={"grad_sync": grad_sync},
        scaling={"num_workers": 2 * tp * pp, "cpus_per_worker": 0.5 / tp / pp},
        tracking={"enabled": False},
    )
    result = fit_or_fail(cfg)
    assert (result.split.num_workers, result.split.data_parallel) == (2 * tp * pp, 2)
    record = result.history[0]
    assert record["scaling/num_workers"] == 2 * tp * pp
    if tp > 1:
        # each layer's colwise q, k, v and MLP input all-reduce their input's gradient, the
        # attention and MLP outputs theirs in forward, the fused bias gathers its share; the
        # recomputed forward all-reduces the attention's again (not the MLP's: recomputation
        # stops once the saved tensors are back); and the gradient norm's one over `tp`
        again = 1 if recompute == "full" else 0
        accum = record["scaling/grad_accum_steps"]
        assert record["comm/tp_allreduce_calls"] == accum * 2 * (4 + again) + 1, record
        assert record["comm/tp_all_gather_calls"] == accum * 2, record
    else:
        assert "comm/tp_allreduce_calls" not in record, record
    assert record["train/items"] == sum(len(s) - 1 for s in seqs)
    units = 3  # two blocks and the root
    expected = units * (4 if grad_sync == "every_micro_step" else 1)
    if pp > 1:  # rank 0's stage: the embeddings and a block; reduced once per window
        expected = 2
        accum = record["scaling/grad_accum_steps"]
        # its activations sent on, one per micro-batch; 1F1B's bubble (P − 1) / (m + P − 1)
        assert record["comm/p2p_sends"] == accum, record
        assert record["perf/pipeline_bubble"] == pytest.approx(1 / (accum + 1))
        assert 0 <= record["perf/pipeline_idle_frac"] < 1, record
    else:
        assert "comm/p2p_sends" not in record, record
    assert record["comm/reduce_scatter_calls"] == expected, record
    assert record["perf/tokens_per_s"] > 0 and record["perf/tflops"] > 0
    assert "perf/mfu" not in record, "no known peak on CPU: no MFU"
    # recomputed blocks are hardware FLOPs, counted apart from the model's
    if recompute == "full":
        assert record["perf/hardware_tflops"] > record["perf/tflops"], record
    else:
        assert "perf/hardware_tflops" not in record, record
    assert 0 < record["comm/sync_time_frac"] < 1, record

    err, floor = sgd_step_errors(cfg, padded_token_loss(seqs), load_model(result.checkpoint_dir))
    record_equivalence(
        f"Ray Train, FSDP2 {grad_sync}, activation checkpointing {recompute}, chunked loss "
        f"{chunk}, compiled blocks {compile_}, GPT, padded tokens, 2 data-parallel workers × "
        f"{tp} tensor-parallel × {pp} pipeline stages (vs float64; fp32 full batch: "
        f"{floor:.3e})",
        err,
    )
    assert err <= 2 * floor, (err, floor)


def test_fsdp_resumes_at_another_worker_count_where_an_epoch_has_fewer_rows_than_workers(
    ray_local, tmp_path
):
    """A sharded run's checkpoint holds every rank's shards (each rank writes its own file; no
    whole model in `state.pt`) and loading reshards, AdamW's state with the weights: 3 steps on
    1 worker, then --resume on 2 workers to step 5, ends where 5 steps on 2 workers end.
    49 rows, global batch 16: on 1 worker epoch 0 is 3 windows and a short one of 1 row; on 2
    workers that row is fewer than the workers (no window: the run goes on in epoch 1), and
    the auto search and the spare row of lockstep forwards must not read a window that epoch
    does not have. Resumed again with no steps left, the run ends cleanly (no rank has a row
    to hold)."""
    path = tmp_path / "tokens.parquet"
    rows = np.random.default_rng(4).integers(0, 17, (49, 9)).tolist()
    pq.write_table(pa.table({"tokens": pa.array(rows, pa.list_(pa.uint16()))}), path)

    def cfg_for(name: str, workers: int, steps: int) -> TrainConfig:
        return config(
            tmp_path,
            seed=5,
            model={"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8},
            data={"source": str(path), "shuffle": True, "seq_len": 8},
            batch={"global_batch_size": 16, "micro_batch_size": "auto", "memory_budget_mb": 4096},
            optim={"name": "adamw", "lr": 0.01},
            train={"strategy": "fsdp", "max_steps": steps, "epochs": 2},
            fsdp={"grad_sync": "window_end"},
            scaling={"num_workers": workers, "cpus_per_worker": 0.5},
            tracking={"enabled": False},
            run={"storage_path": str(tmp_path / "runs"), "name": name},
        )

    straight = fit_or_fail(cfg_for("straight", 2, 5))
    first = fit_or_fail(cfg_for("resized", 1, 3))
    assert first.summary["train_state"]["epoch"] == 0
    resized = fit_or_fail(cfg_for("resized", 2, 5), resume=True)
    assert resized.summary["resumed_from"] == 3
    assert resized.summary["train_state"]["optimizer_step"] == 5
    assert resized.summary["train_state"]["epoch"] == 1
    shards = Path(resized.checkpoint_dir) / "shards"
    assert sorted(p.name for p in shards.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    saved = torch.load(Path(resized.checkpoint_dir) / "state.pt", weights_only=True)
    assert "model" not in saved and "optimizer" not in saved
    a, b = (weights(load_model(r.checkpoint_dir)) for r in (straight, resized))
    assert rel_diff(b, a) <= 1e-5, rel_diff(b, a)
    done = fit_or_fail(cfg_for("resized", 2, 5), resume=True)
    assert done.summary["resumed_from"] == 5 and done.summary["total_steps"] == 5


def test_auto_micro_batch_with_compile_keeps_the_global_batch_and_the_step(
    ray_local, tmp_path, record_equivalence
):
    """A CPU memory budget between what micro-batches of 8 and 16 need: the search picks 8
    (accumulation 2 at 2 workers × 16 samples), and the compiled run steps like the eager
    fixed-micro one."""
    from rayacc.engine import classification_item_losses
    from rayacc.engine.autobatch import measure_step_bytes

    model = build_model(config(tmp_path))
    used = {
        n: measure_step_bytes(
            model,
            classification_item_losses,
            {"features": torch.randn(n, 64), "label": torch.zeros(n, dtype=torch.long)},
            optimizer_slots=0,
        )
        for n in (8, 16)
    }
    budget_mb = (used[8] + used[16]) / 2 / 2**20
    auto = config(
        tmp_path,
        batch={"global_batch_size": 32, "micro_batch_size": "auto", "memory_budget_mb": budget_mb},
        data={"shuffle": False},
        train={"max_steps": 3, "compile": True},
        optim={"momentum": 0.0},
        tracking={"experiment": "auto-micro"},
    )
    result = fit_or_fail(auto)
    assert (result.split.micro_batch_size, result.split.grad_accum_steps) == (8, 2)
    assert [r["scaling/micro_batch_size"] for r in result.history] == [8, 8, 8]
    assert all(r["train/samples"] == 32 for r in result.history)
    assert all(0 <= r["perf/data_wait_frac"] < 1 for r in result.history)

    client = MlflowClient(auto.tracking.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("auto-micro").experiment_id])
    assert run.data.params["micro_batch_size"] == "8"
    assert run.data.params["grad_accum_steps"] == "2"
    assert run.data.params["batch.micro_batch_size"] == "auto"
    assert "micro 8 × accum 2 (auto search)" in run.data.tags["rayacc.micro_batch_events"]

    # the same 3 steps in this process, eager, each on its whole window (no shuffle: step s
    # is rows 32s..32s+31)
    table = pq.read_table(prepare_bundled("digits")).slice(0, 96)
    x = torch.tensor(np.stack(table["features"].to_numpy(zero_copy_only=False)))
    y = torch.tensor(table["label"].to_numpy())
    eager = build_model(auto)
    for step in range(3):
        eager.zero_grad()
        F.cross_entropy(
            eager(x[32 * step : 32 * step + 32]), y[32 * step : 32 * step + 32]
        ).backward()
        with torch.no_grad():
            for p in eager.parameters():
                p -= 0.1 * p.grad
    err = rel_diff(weights(load_model(result.checkpoint_dir)), weights(eager))
    record_equivalence(
        "Ray Train, compiled + auto micro (8×2) vs eager one process, 3 SGD steps", err
    )
    # compiled kernels fuse and reorder float operations: equal up to fp32 rounding
    assert err <= 1e-5, err
