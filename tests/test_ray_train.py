"""The main job on a real local Ray with a real MLflow store: no mocks of either."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from mlflow.tracking import MlflowClient

from rayacc import TrainConfig, build_model, fit, load_model
from rayacc.data.sources import prepare_bundled

pytestmark = pytest.mark.ray

FIT_TIMEOUT_S = 300


def fit_or_fail(cfg: TrainConfig, resume: bool = False):
    """fit() with a deadline: a DDP hang fails the test instead of stalling the suite."""
    box: dict = {}

    def run():
        try:
            box["result"] = fit(cfg, resume=resume)
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(FIT_TIMEOUT_S)
    if t.is_alive():
        pytest.fail(f"fit did not finish in {FIT_TIMEOUT_S} s (hung workers?)")
    if "error" in box:
        raise box["error"]
    return box["result"]


def digits_subset(path, n: int):
    table = pq.read_table(prepare_bundled("digits")).slice(0, n)
    pq.write_table(table, path)
    return str(path)


def config(tmp_path, **sections) -> TrainConfig:
    base = {
        "seed": 3,
        "model": {"name": "mlp", "hidden_sizes": [32]},
        "data": {"source": "digits", "val_fraction": 0.0},
        "batch": {"global_batch_size": 32, "micro_batch_size": 4},
        "optim": {"name": "sgd", "lr": 0.1, "schedule": "constant"},
        "train": {"max_steps": 1},
        "scaling": {"num_workers": 2, "cpus_per_worker": 0.5},
        "tracking": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "tests"},
        "run": {"storage_path": str(tmp_path / "runs")},
    }
    for name, values in sections.items():
        if isinstance(values, dict):
            base.setdefault(name, {}).update(values)
        else:
            base[name] = values
    return TrainConfig.from_dict(base)


def weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in model.state_dict().values()])


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_end_to_end_fit_records_contract_params_and_every_step(ray_local, tmp_path):
    cfg = config(
        tmp_path,
        data={"val_fraction": 0.2},
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
    )
    result = fit_or_fail(cfg)

    client = MlflowClient(cfg.tracking.tracking_uri)
    run = client.get_run(result.mlflow_run_id)
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


def sgd_step_errors(cfg: TrainConfig, full_batch_loss, trained_model) -> tuple[float, float]:
    """Distance of the trained weights, and of plain fp32 full-batch SGD (lr 0.1), from the
    float64 full-batch step, each relative to the size of that step.

    fp32 weights round at ~1e-7 of their size, ~1e-6 of a small update: the fair bar for the
    pipeline is plain fp32 full-batch training's own distance from the float64 step.
    """

    def step(dtype):
        ref = build_model(cfg).to(dtype)
        before = weights(ref)
        full_batch_loss(ref, dtype).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= 0.1 * p.grad
        return before, weights(ref)

    before, exact = step(torch.float64)
    _, plain_fp32 = step(torch.float32)
    scale = (exact - before).norm()
    trained = weights(trained_model)
    return float((trained - exact).norm() / scale), float((plain_fp32 - exact).norm() / scale)


def padded_token_rows(path, seed: int, dtype) -> list[list[int]]:
    """16 token sequences of 2 to 20 tokens written to `path`, short ones first (the first
    rank's half of a window then has far fewer tokens); returns them."""
    rng = np.random.default_rng(seed)
    seqs = sorted((rng.integers(0, 17, rng.integers(2, 21)).tolist() for _ in range(16)), key=len)
    pq.write_table(pa.table({"tokens": pa.array(seqs, pa.list_(dtype))}), path)
    return seqs


def padded_token_loss(seqs):
    """The full-batch loss of `seqs` in one process: the mean over every target token."""
    from rayacc.engine import IGNORE_INDEX, collate_tokens

    def loss(model, dtype):
        batch = collate_tokens(seqs)
        logits = model(batch["input"])
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            batch["target"].reshape(-1),
            ignore_index=IGNORE_INDEX,
        )

    return loss


def one_batch_config(tmp_path, workers: int, micro: int, accum: int) -> TrainConfig:
    source = digits_subset(tmp_path / "one_batch.parquet", 32)
    return config(
        tmp_path,
        data={"source": source, "shuffle": False},
        batch={"global_batch_size": 32, "micro_batch_size": micro, "grad_accum_steps": accum},
        scaling={"num_workers": workers, "cpus_per_worker": 0.5},
        tracking={"enabled": False},
    )


@pytest.mark.parametrize(("workers", "micro", "accum"), [(1, 8, 4), (2, 4, 4)])
def test_whole_stack_step_equals_full_batch(
    ray_local, tmp_path, workers, micro, accum, record_equivalence
):
    cfg = one_batch_config(tmp_path, workers, micro, accum)
    result = fit_or_fail(cfg)

    table = pq.read_table(cfg.data.source)
    features = np.stack(table["features"].to_numpy(zero_copy_only=False))
    labels = torch.tensor(table["label"].to_numpy())

    def full_batch_loss(model, dtype):
        return F.cross_entropy(model(torch.tensor(features, dtype=dtype)), labels)

    err, floor = sgd_step_errors(cfg, full_batch_loss, load_model(result.checkpoint_dir))
    record_equivalence(
        f"Ray Train, {workers} worker(s) × micro {micro} × accum {accum} "
        f"(vs float64; fp32 full batch: {floor:.3e})",
        err,
    )
    assert err <= 2 * floor, (err, floor)


def test_same_config_twice_and_same_global_batch_give_same_weights(
    ray_local, tmp_path, record_equivalence
):
    source = digits_subset(tmp_path / "d160.parquet", 160)
    common = dict(
        data={"source": source, "shuffle": True},
        optim={"momentum": 0.9},
        train={"epochs": 2, "max_steps": None},
        tracking={"enabled": False},
    )
    a = fit_or_fail(
        config(tmp_path, batch={"global_batch_size": 32, "micro_batch_size": 4}, **common)
    )
    b = fit_or_fail(
        config(tmp_path, batch={"global_batch_size": 32, "micro_batch_size": 4}, **common)
    )
    c = fit_or_fail(
        config(
            tmp_path,
            batch={"global_batch_size": 32, "micro_batch_size": 16},
            scaling={"num_workers": 1},
            **common,
        )
    )
    assert a.summary["train_state"]["optimizer_step"] == 10
    wa, wb, wc = (weights(load_model(r.checkpoint_dir)) for r in (a, b, c))
    assert torch.equal(wa, wb), "two runs of one config must give identical weights"
    err = rel_diff(wc, wa)
    record_equivalence("Ray Train, 10 shuffled SGD-momentum steps: (2w, 4×4) vs (1w, 16×2)", err)
    assert err <= 1e-5, err


def test_uneven_rows_with_shuffle_complete(ray_local, tmp_path, capfd):
    source = digits_subset(tmp_path / "d203.parquet", 203)
    # nothing listens on port 9: tracking turns off with one message and training goes on
    cfg = config(
        tmp_path,
        data={"source": source, "shuffle": True},
        train={"epochs": 2, "max_steps": None},
        tracking={"tracking_uri": "http://127.0.0.1:9"},
    )
    result = fit_or_fail(cfg)
    err = capfd.readouterr().err
    assert err.count("tracking off, training goes on") == 1, err
    assert result.mlflow_run_id is None
    # 203 rows = 6 windows of 32 + a short window of 11 (6 and 5 rows on the two ranks)
    assert [r["train/samples"] for r in result.history] == [32] * 6 + [11] + [32] * 6 + [11]
    assert result.summary["train_state"]["samples_seen"] == 2 * 203


def test_ranks_that_read_files_read_a_bundled_dataset_from_the_shared_storage(ray_local, tmp_path):
    """The ranks' Ray Data read tasks (data.in_process_read_max_mb=0: even small data) run on
    any node, so the bundled dataset (prepared in the driver node's cache) is staged under
    run.storage_path first."""
    cfg = config(
        tmp_path,
        data={"source": "digits", "in_process_read_max_mb": 0},
        train={"max_steps": 2},
        tracking={"enabled": False},
    )
    result = fit_or_fail(cfg)
    assert result.summary["train_state"]["optimizer_step"] == 2
    assert (tmp_path / "runs" / "_data" / "digits.parquet").is_file()


def test_two_runs_with_dropout_give_the_same_weights(ray_local, tmp_path):
    source = digits_subset(tmp_path / "d160.parquet", 160)
    runs = [
        fit_or_fail(
            config(
                tmp_path / name,
                model={"dropout": 0.1},
                data={"source": source, "shuffle": True},
                train={"max_steps": 5},
                tracking={"enabled": False},
            )
        )
        for name in ("a", "b")
    ]
    wa, wb = (weights(load_model(r.checkpoint_dir)) for r in runs)
    assert torch.equal(wa, wb), "dropout must draw the same masks in two runs of one config"


def test_a_size_that_ran_out_of_memory_in_training_is_not_chosen_again(ray_local, tmp_path):
    """Out of memory in a window's last micro-step cannot be retried in place (the peers
    already wait in the gradient all-reduce): the group restarts, and its auto search stays
    below every size that failed. Micro 32 and then 16 fail here; 8 trains."""
    cfg = config(
        tmp_path,
        model={
            "name": "factory",
            "factory": "tests.oom_model:build",
            "kwargs": {"threshold": 16},
        },
        batch={"global_batch_size": 64, "micro_batch_size": "auto", "memory_budget_mb": 4096},
        train={"max_steps": 2},
        run={"max_failures": 3},
        tracking={"enabled": False},
    )
    result = fit_or_fail(cfg)
    assert [r["scaling/micro_batch_size"] for r in result.history] == [8, 8]
    assert result.summary["plan"]["micro_batch_size"] == 8


def test_a_sharded_search_trial_out_of_memory_restarts_the_group_below_it(ray_local, tmp_path):
    """Under FSDP a search trial that runs out of memory is not retried in place (the peers may
    wait in its collectives): the group fails after recording the size, restarts, and its
    search stays below. Of 1..32 per worker the search tries 4, then 16 (out of memory); after
    the restart 2, 4 and 8, and 8 trains."""
    cfg = config(
        tmp_path,
        model={
            "name": "factory",
            "factory": "tests.oom_model:build",
            "kwargs": {"threshold": 16, "always": True},
        },
        batch={"global_batch_size": 64, "micro_batch_size": "auto", "memory_budget_mb": 4096},
        train={"max_steps": 2, "strategy": "fsdp"},
        run={"max_failures": 2},
        tracking={"enabled": False},
    )
    result = fit_or_fail(cfg)
    assert [r["scaling/micro_batch_size"] for r in result.history] == [8, 8]


def test_wrong_columns_are_reported_before_workers_start(tmp_path):
    from rayacc.data.sources import DataError
    from rayacc.runner.prelaunch import prepare

    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"x": [1.0, 2.0]}), path)
    cfg = config(tmp_path, data={"source": str(path)})
    with pytest.raises(DataError, match=r"match no format.*`features`"):
        prepare(cfg)


def test_gpt_on_padded_token_rows_equals_full_batch(ray_local, tmp_path, record_equivalence):
    """Variable-length sequences, padded per micro-batch, ranks with different token counts."""
    path = tmp_path / "tokens.parquet"
    seqs = padded_token_rows(path, seed=0, dtype=pa.int64())
    cfg = config(
        tmp_path,
        model={"name": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 32},
        data={"source": str(path), "shuffle": False, "seq_len": 32},
        batch={"global_batch_size": 16, "micro_batch_size": 2},
        # a few positions per chunk: the chunked cross-entropy crosses many chunk boundaries
        train={"loss_chunk_tokens": 7},
        tracking={"enabled": False},
    )
    result = fit_or_fail(cfg)
    record = result.history[0]
    assert record["train/items"] == sum(len(s) - 1 for s in seqs)
    assert record["perf/tokens_per_s"] > 0 and record["perf/tflops"] > 0
    assert "perf/mfu" not in record, "no known peak on CPU: no MFU"

    err, floor = sgd_step_errors(cfg, padded_token_loss(seqs), load_model(result.checkpoint_dir))
    record_equivalence(
        f"Ray Train, GPT, padded tokens, 2 workers (vs float64; fp32 full batch: {floor:.3e})", err
    )
    assert err <= 2 * floor, (err, floor)


@pytest.mark.parametrize(
    ("grad_sync", "recompute", "chunk", "compile_", "micro"),
    [("every_micro_step", "none", None, True, 2), ("window_end", "full", 8, False, "auto")],
)
def test_fsdp_on_padded_token_rows_equals_full_batch(
    ray_local, tmp_path, record_equivalence, grad_sync, recompute, chunk, compile_, micro
):
    """train.strategy=fsdp through the whole stack: Ray workers shard the GPT with FSDP2,
    accumulate in either sync mode (with activation checkpointing, the chunked loss, which
    runs inside the sharded forward, and the auto micro-batch search, whose trials run without
    sync, in one), and the step equals the full batch in one process; the model loads whole
    from the sharded checkpoint. The reduce-scatters are counted and timed."""
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
        },
        fsdp={"grad_sync": grad_sync},
        tracking={"enabled": False},
    )
    result = fit_or_fail(cfg)
    record = result.history[0]
    assert record["train/items"] == sum(len(s) - 1 for s in seqs)
    units = 3  # two blocks and the root
    expected = units * (4 if grad_sync == "every_micro_step" else 1)
    assert record["comm/reduce_scatter_calls"] == expected, record
    assert 0 < record["comm/sync_time_frac"] < 1, record

    err, floor = sgd_step_errors(cfg, padded_token_loss(seqs), load_model(result.checkpoint_dir))
    record_equivalence(
        f"Ray Train, FSDP2 {grad_sync}, activation checkpointing {recompute}, chunked loss "
        f"{chunk}, compiled blocks {compile_}, GPT, padded tokens, 2 workers (vs float64; fp32 "
        f"full batch: {floor:.3e})",
        err,
    )
    assert err <= 2 * floor, (err, floor)


def test_fsdp_resumes_at_another_worker_count_from_its_checkpoint(ray_local, tmp_path):
    """A sharded run's checkpoint holds every rank's shards (each rank writes its own file; no
    whole model in `state.pt`) and loading reshards: 2 steps on 2 workers, then --resume on 1
    worker to step 4, ends where 4 steps on 2 workers end."""
    rng = np.random.default_rng(2)
    path = tmp_path / "tokens.parquet"
    rows = rng.integers(0, 17, (48, 9)).tolist()
    pq.write_table(pa.table({"tokens": pa.array(rows, pa.list_(pa.uint16()))}), path)

    def cfg_for(name: str, workers: int, steps: int) -> TrainConfig:
        return config(
            tmp_path,
            seed=5,
            model={"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8},
            data={"source": str(path), "shuffle": True, "seq_len": 8},
            batch={"global_batch_size": 16, "micro_batch_size": 4},
            optim={"name": "adamw", "lr": 0.01},
            train={"strategy": "fsdp", "max_steps": steps, "epochs": 2, "loss_chunk_tokens": None},
            scaling={"num_workers": workers, "cpus_per_worker": 0.5},
            tracking={"enabled": False},
            run={"storage_path": str(tmp_path / "runs"), "name": name},
        )

    straight = fit_or_fail(cfg_for("straight", 2, 4))
    halfway = fit_or_fail(cfg_for("resized", 2, 2))
    shards = Path(halfway.checkpoint_dir) / "shards"
    assert sorted(p.name for p in shards.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    saved = torch.load(Path(halfway.checkpoint_dir) / "state.pt", weights_only=True)
    assert "model" not in saved and "optimizer" not in saved
    resumed = fit_or_fail(cfg_for("resized", 1, 4), resume=True)
    assert resumed.summary["resumed_from"] == 2
    assert resumed.summary["train_state"]["optimizer_step"] == 4
    a, b = (weights(load_model(r.checkpoint_dir)) for r in (straight, resumed))
    assert rel_diff(b, a) <= 1e-5, rel_diff(b, a)


def test_fsdp_search_resumed_where_an_epoch_has_fewer_rows_than_workers_and_with_none_left(
    ray_local, tmp_path
):
    """49 rows, global batch 16: on 1 worker an epoch is 3 windows and a short one of 1 row.
    Stopped at step 3 and resumed on 2 workers, the row left in epoch 0 is fewer than the
    workers (no window: the run goes on in epoch 1), and the auto search and the spare row of
    lockstep forwards must not read a window that epoch does not have; resumed again with no
    steps left, the run ends cleanly (no rank has a row to hold)."""
    path = tmp_path / "tokens.parquet"
    rows = np.random.default_rng(4).integers(0, 17, (49, 9)).tolist()
    pq.write_table(pa.table({"tokens": pa.array(rows, pa.list_(pa.uint16()))}), path)

    def cfg_for(workers: int, steps: int) -> TrainConfig:
        return config(
            tmp_path,
            model={"name": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8},
            data={"source": str(path), "shuffle": True, "seq_len": 8},
            batch={"global_batch_size": 16, "micro_batch_size": "auto", "memory_budget_mb": 4096},
            train={"strategy": "fsdp", "max_steps": steps, "epochs": 2},
            fsdp={"grad_sync": "window_end"},
            scaling={"num_workers": workers, "cpus_per_worker": 0.5},
            tracking={"enabled": False},
            run={"storage_path": str(tmp_path / "runs"), "name": "short"},
        )

    first = fit_or_fail(cfg_for(1, 3))
    assert first.summary["train_state"]["epoch"] == 0
    resized = fit_or_fail(cfg_for(2, 5), resume=True)
    assert resized.summary["resumed_from"] == 3
    assert resized.summary["train_state"]["optimizer_step"] == 5
    assert resized.summary["train_state"]["epoch"] == 1
    done = fit_or_fail(cfg_for(2, 5), resume=True)
    assert done.summary["resumed_from"] == 5 and done.summary["total_steps"] == 5


def test_auto_micro_batch_with_compile_keeps_the_global_batch_and_the_step(
    ray_local, tmp_path, record_equivalence
):
    """A CPU memory budget between what micro-batches of 8 and 16 need: the search picks 8
    (accumulation 2 at 2 workers × 16 samples), and the compiled run steps like the eager
    fixed-micro one."""
    from rayacc.engine import classification_item_losses
    from rayacc.engine.autobatch import measure_step_bytes

    common = dict(train={"max_steps": 3}, optim={"momentum": 0.0})
    reference = config(tmp_path, batch={"global_batch_size": 32, "micro_batch_size": 8}, **common)
    model = build_model(reference)
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
        train={"max_steps": 3, "compile": True},
        optim={"momentum": 0.0},
        tracking={"experiment": "auto-micro"},
    )
    result = fit_or_fail(auto)
    fixed = fit_or_fail(
        reference.model_copy(
            update={"tracking": auto.tracking.model_copy(update={"enabled": False})}
        )
    )
    assert (result.plan.micro_batch_size, result.plan.grad_accum_steps) == (8, 2)
    assert [r["scaling/micro_batch_size"] for r in result.history] == [8, 8, 8]
    assert all(r["train/samples"] == 32 for r in result.history)
    assert all(0 <= r["perf/data_wait_frac"] < 1 for r in result.history)

    client = MlflowClient(auto.tracking.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("auto-micro").experiment_id])
    assert run.data.params["micro_batch_size"] == "8"
    assert run.data.params["grad_accum_steps"] == "2"
    assert run.data.params["batch.micro_batch_size"] == "auto"
    assert "micro 8 × accum 2 (auto search)" in run.data.tags["rayacc.micro_batch_events"]

    err = rel_diff(
        weights(load_model(result.checkpoint_dir)), weights(load_model(fixed.checkpoint_dir))
    )
    record_equivalence(
        "Ray Train, compiled + auto micro (8×2) vs eager fixed 8×2, 3 SGD steps", err
    )
    # compiled kernels fuse and reorder float operations: equal up to fp32 rounding
    assert err <= 1e-5, err
