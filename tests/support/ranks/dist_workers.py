"""Rank bodies for the 2-process gloo tests (plain torch.multiprocessing, no Ray).

Every scenario runs on both ranks in one process group; rank 0 writes what it saw to
`out_dir/rank{r}.pt` for the test process to compare with single-process references.
"""

from __future__ import annotations

import datetime
import traceback

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from rayacc.engine import (
    AccumulationStep,
    MicroStepMismatchError,
    build_scheduler,
    classification_item_losses,
    count_target_tokens,
    install_comm_counter,
    token_item_losses,
)
from tests.support.ranks.engine_helpers import (
    TinyCausalLM,
    TinyClassifier,
    classification_rows,
    micro_batches,
    params_vector,
    slice_rows,
    token_micro_batches,
    token_sequences,
)

LR = 0.5
GLOBAL_ROWS = 24
MICRO = 3  # 2 ranks × 4 micro-steps × 3 = 24


def shard(rank: int, world: int, n: int) -> tuple[int, int]:
    """Rank r's contiguous share of a window of n samples (docs/design.md, data order)."""
    per = n // world
    return rank * per, (rank + 1) * per


def long_and_short_token_shards(rank: int):
    """Rank 0 holds short sequences, rank 1 long ones: different token counts per rank."""
    seqs = token_sequences(16, seed=5, min_len=2, max_len=14)
    seqs = sorted(seqs, key=len)
    return seqs, seqs[rank * 8 : (rank + 1) * 8]


def scenario_classify(rank, world, out):
    rows = classification_rows(GLOBAL_ROWS)
    model = DDP(TinyClassifier())
    step = AccumulationStep(model, torch.optim.SGD(model.parameters(), lr=LR))
    lo, hi = shard(rank, world, GLOBAL_ROWS)
    result = step(micro_batches(slice_rows(rows, lo, hi), MICRO), classification_item_losses)
    out["classify"] = {"params": params_vector(model), "result": result}


def scenario_classify_with_ddp_default_hook(rank, world, out):
    """Without the engine's hook DDP averages the gradients over ranks; the engine's factor
    must then carry the world size."""
    rows = classification_rows(GLOBAL_ROWS)
    model = DDP(TinyClassifier())
    step = AccumulationStep(model, torch.optim.SGD(model.parameters(), lr=LR), count_comm=False)
    lo, hi = shard(rank, world, GLOBAL_ROWS)
    result = step(micro_batches(slice_rows(rows, lo, hi), MICRO), classification_item_losses)
    out["default_hook"] = {"params": params_vector(model), "result": result}


def scenario_tokens(rank, world, out):
    _, mine = long_and_short_token_shards(rank)
    model = DDP(TinyCausalLM())
    step = AccumulationStep(model, torch.optim.SGD(model.parameters(), lr=LR))
    result = step(token_micro_batches(mine, 2), token_item_losses, count_target_tokens)
    local_tokens = sum(len(s) - 1 for s in mine)
    out["tokens"] = {"params": params_vector(model), "result": result, "local_tokens": local_tokens}


def scenario_adamw_steps(rank, world, out):
    """Three AdamW steps with warmup, cosine and clipping on consecutive windows."""
    rows = classification_rows(3 * GLOBAL_ROWS, seed=7)
    model = DDP(TinyClassifier())
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    sched = build_scheduler(opt, warmup_steps=1, total_steps=3, min_lr_ratio=0.1)
    step = AccumulationStep(model, opt, scheduler=sched, max_grad_norm=0.5)
    for s in range(3):
        window = slice_rows(rows, s * GLOBAL_ROWS, (s + 1) * GLOBAL_ROWS)
        lo, hi = shard(rank, world, GLOBAL_ROWS)
        step(micro_batches(slice_rows(window, lo, hi), MICRO), classification_item_losses)
    out["adamw"] = {"params": params_vector(model)}


def wide_classifier() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 1024),
        torch.nn.Tanh(),
        torch.nn.Linear(1024, 768),
        torch.nn.Tanh(),
        torch.nn.Linear(768, 3),
    )


def scenario_sync_counts(rank, world, out):
    """Gradient all-reduce passes per optimizer step: with the engine (no_sync) and with a
    plain loop that lets DDP sync on every micro-step."""
    rows = classification_rows(GLOBAL_ROWS)
    lo, hi = shard(rank, world, GLOBAL_ROWS)
    mbs = micro_batches(slice_rows(rows, lo, hi), MICRO)

    model = DDP(wide_classifier(), bucket_cap_mb_list=[1, 1, 1, 1])  # ~3 MB of gradients: 4 buckets
    step = AccumulationStep(model, torch.optim.SGD(model.parameters(), lr=LR))
    engine_counts = [
        (r.sync_passes, r.allreduce_calls)
        for r in (step(mbs, classification_item_losses) for _ in range(2))
    ]

    plain = DDP(wide_classifier(), bucket_cap_mb_list=[1, 1, 1, 1])
    counter = install_comm_counter(plain)
    opt = torch.optim.SGD(plain.parameters(), lr=LR)
    counter.begin_window()
    for mb in mbs:
        classification_item_losses(plain, mb).mean().backward()
    opt.step()
    out["sync"] = {
        "engine": engine_counts,
        "plain_passes": counter.passes,
        "plain_launches": counter.launches,
        "micro_steps": len(mbs),
    }


def scenario_nan_on_one_rank(rank, world, out):
    rows = classification_rows(GLOBAL_ROWS)
    model = DDP(TinyClassifier())
    before = params_vector(model)
    step = AccumulationStep(model, torch.optim.SGD(model.parameters(), lr=LR))
    lo, hi = shard(rank, world, GLOBAL_ROWS)

    def loss_fn(m, batch):
        losses = classification_item_losses(m, batch)
        return losses * float("nan") if rank == 1 else losses

    result = step(micro_batches(slice_rows(rows, lo, hi), MICRO), loss_fn)
    out["nan"] = {
        "skipped": result.skipped,
        "reason": result.skip_reason,
        "unchanged": bool(torch.equal(params_vector(model), before)),
    }


def scenario_micro_step_mismatch(rank, world, out):
    rows = classification_rows(GLOBAL_ROWS)
    model = DDP(TinyClassifier())
    step = AccumulationStep(model, torch.optim.SGD(model.parameters(), lr=LR))
    lo, hi = shard(rank, world, GLOBAL_ROWS)
    mbs = micro_batches(slice_rows(rows, lo, hi), MICRO)
    if rank == 1:
        mbs = mbs[:-1]  # one micro-step fewer on rank 1
    try:
        step(mbs, classification_item_losses)
        out["mismatch"] = "no error"
    except MicroStepMismatchError as exc:
        out["mismatch"] = str(exc)


def scenario_out_of_memory_on_one_rank(rank, world, out):
    """Rank 1 'runs out of memory' on micro-batches of more than 2 rows, in its second
    micro-step: both ranks cut their micro-batches in two and redo the window."""
    rows = classification_rows(GLOBAL_ROWS)
    model = DDP(TinyClassifier())
    step = AccumulationStep(model, torch.optim.SGD(model.parameters(), lr=LR), oom_retry=True)
    lo, hi = shard(rank, world, GLOBAL_ROWS)
    calls = []

    def loss_fn(m, batch):
        calls.append(len(batch["label"]))
        if rank == 1 and len(calls) == 2 and len(batch["label"]) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return classification_item_losses(m, batch)

    result = step(micro_batches(slice_rows(rows, lo, hi), MICRO), classification_item_losses)
    first = {"splits": result.micro_batch_splits, "micro_steps": result.micro_steps}
    # the next window is cut the same way from the start
    model2 = DDP(TinyClassifier())
    step2 = AccumulationStep(model2, torch.optim.SGD(model2.parameters(), lr=LR), oom_retry=True)
    result2 = step2(micro_batches(slice_rows(rows, lo, hi), MICRO), loss_fn)
    after_retry = params_vector(model2)
    second = step2(micro_batches(slice_rows(rows, lo, hi), MICRO), classification_item_losses)
    out["oom"] = {
        "no_oom": first,
        "params_after_retry": after_retry,
        "result": result2,
        "calls": calls,
        "next_window": {"splits": second.micro_batch_splits, "micro_steps": second.micro_steps},
    }


def scenario_out_of_memory_without_retry_raises(rank, world, out):
    """Without oom_retry an out-of-memory error is not swallowed."""
    model = DDP(TinyClassifier())
    step = AccumulationStep(model, torch.optim.SGD(model.parameters(), lr=LR))

    def loss_fn(m, batch):
        raise torch.OutOfMemoryError("CUDA out of memory")

    try:
        step(micro_batches(classification_rows(6), MICRO), loss_fn)
        out["oom_plain"] = "no error"
    except torch.OutOfMemoryError as exc:
        out["oom_plain"] = str(exc)


def scenario_stats_beside_a_bf16_bucket(rank, world, out):
    """bf16 gradients cannot carry exact counts: the window's stats take their own all-reduce."""
    rows = classification_rows(GLOBAL_ROWS)
    model = DDP(TinyClassifier().to(torch.bfloat16))
    step = AccumulationStep(model, torch.optim.SGD(model.parameters(), lr=LR))
    lo, hi = shard(rank, world, GLOBAL_ROWS)

    def loss_fn(m, batch):
        return classification_item_losses(m, {**batch, "features": batch["features"].bfloat16()})

    with torch.no_grad():
        mine = sum(
            loss_fn(model, mb).float().sum() for mb in micro_batches(slice_rows(rows, lo, hi), 3)
        )
    result = step(micro_batches(slice_rows(rows, lo, hi), MICRO), loss_fn)
    out["bf16"] = {"result": result, "local_loss_sum": float(mine)}


def scenario_rank_figures_ride_the_window(rank, world, out):
    """Every rank's figures reach every rank inside the window's gradient all-reduce: a window
    with them launches as many all-reduces as one without."""
    rows = classification_rows(GLOBAL_ROWS)
    model = DDP(TinyClassifier())
    step = AccumulationStep(model, torch.optim.SGD(model.parameters(), lr=LR))
    lo, hi = shard(rank, world, GLOBAL_ROWS)
    batches = micro_batches(slice_rows(rows, lo, hi), MICRO)
    calls = []
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    dist.all_reduce = counting
    try:
        step(batches, classification_item_losses)  # DDP settles its buckets after the first
        before = len(calls)
        plain = step(batches, classification_item_losses)
        between = len(calls)
        report = [rank + 0.5, 100.0 * rank, 7.25]
        reported = step(batches, classification_item_losses, figures=report)
        after = len(calls)
    finally:
        dist.all_reduce = real
    out["figures_by_rank"] = {
        "plain_calls": between - before,
        "reported_calls": after - between,
        "plain": plain.figures_by_rank,
        "reported": reported.figures_by_rank,
        "items": reported.items,
        "optimizer_time_s": reported.optimizer_time_s,
    }


SCENARIOS = [
    scenario_classify,
    scenario_classify_with_ddp_default_hook,
    scenario_tokens,
    scenario_adamw_steps,
    scenario_sync_counts,
    scenario_nan_on_one_rank,
    scenario_micro_step_mismatch,
    scenario_out_of_memory_on_one_rank,
    scenario_out_of_memory_without_retry_raises,
    scenario_stats_beside_a_bf16_bucket,
    scenario_rank_figures_ride_the_window,
]


def run_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    run_scenarios(rank, world, init_file, out_dir, SCENARIOS)


def run_scenarios(rank: int, world: int, init_file: str, out_dir: str, scenarios) -> None:
    """Runs `scenarios` (functions of rank, world, out) in one gloo group; saves `out`."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    torch.set_num_threads(1)
    out: dict = {}
    try:
        for scenario in scenarios:
            scenario(rank, world, out)
            dist.barrier()
    except Exception:
        out["error"] = traceback.format_exc()
        raise
    finally:
        torch.save(out, f"{out_dir}/rank{rank}.pt")
        dist.destroy_process_group()
