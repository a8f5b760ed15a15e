"""What rank 0 reports: the record of one optimizer step, as it goes to the driver (MLflow keys
of the project's contract), and the summary of the run a worker group ends with."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from rayacc.config.batch_split import BatchSplit
from rayacc.engine import StepCost, StepResult

__all__ = ["run_summary", "step_record"]


def step_record(
    result: StepResult,
    *,
    step: int,
    epoch: int,
    wall_s: float,
    data_s: float,
    split: BatchSplit,
    micro_now: int,
    accum_now: int,
    skipped_steps: int,
    rows_read: int,
    rss_mb: float,
    flops_per_item: float | None,
    peak_tflops: float | None,
    token_items: bool,
    recompute_flops_per_item: float = 0.0,
) -> dict[str, Any]:
    """`micro_now` / `accum_now`: the micro-batch and accumulation that ran (an out-of-memory
    retry cuts the planned ones)."""
    record = {
        "step": step,
        "train/loss": result.loss,
        # a setting's value, not a result: the schedule's float noise (0.0006000000000000001)
        # rounded off
        "train/lr": float(f"{result.lr:.12g}"),
        "train/grad_norm": result.grad_norm,
        "train/items": result.items,
        "train/samples": result.samples,
        "train/samples_per_s": result.samples / wall_s if wall_s > 0 else 0.0,
        "train/skipped_steps": skipped_steps,
        "scaling/num_workers": split.num_workers,
        **({"scaling/data_parallel_size": split.data_parallel} if split.model_parallel > 1 else {}),
        "scaling/grad_accum_steps": accum_now,
        "scaling/micro_batch_size": micro_now,
        "scaling/global_batch_size": split.global_batch_size,
        # rows of a window per data-parallel rank: equal, or uneven at an elastic size
        "scaling/share_max": max(split.rank_shares),
        "scaling/share_min": min(split.rank_shares),
        "comm/allreduce_calls": result.allreduce_calls,
        "comm/reduce_scatter_calls": result.reduce_scatter_calls,
        "comm/all_gather_calls": result.all_gather_calls,
        "data/rows_read": rows_read,
        "comm/sync_time_frac": result.sync_time_frac,
        "mem/peak_mb": result.peak_memory_mb,
        "mem/rss_mb": rss_mb,
        "epoch": epoch,
    }
    cost = StepCost(
        wall_s=wall_s,
        data_s=data_s,
        items=result.items,
        world_size=split.num_workers,  # every worker's share, a tensor-parallel group's too
        flops_per_item=flops_per_item,
        peak_tflops=peak_tflops,
        recompute_flops_per_item=recompute_flops_per_item,
    )
    tp = result.tensor_parallel_calls
    if tp is not None:
        # apart from the data-parallel ones: the layers' all-reduces (forward and backward)
        # and the gradient norm's
        record["comm/tp_allreduce_calls"] = tp.allreduce
        record["comm/tp_all_gather_calls"] = tp.all_gather
        record["comm/tp_reduce_scatter_calls"] = tp.reduce_scatter
    pp = result.pipeline
    if pp is not None:
        record["comm/p2p_sends"] = pp.p2p_sends
        # the measured idle share against the schedule's own
        record["perf/pipeline_idle_frac"] = pp.idle_s / max(result.step_time_s, 1e-9)
        record["perf/pipeline_bubble"] = pp.bubble
    record.update(cost.metrics(token_items=token_items))
    return record


def run_summary(
    *,
    metrics: dict[str, Any],
    val: dict[str, float],
    state,
    split: BatchSplit,
    effective_lr: float,
    total_steps: int,
    resumed_from: int | None,
    train_time_s: float,
    log_time_s: float,
    device,
    timeline: dict[str, float],
    token_model: bool,
    worker_nodes: tuple[str, ...],
) -> dict[str, Any]:
    """The fit's summary (rank 0's return value)."""
    import torch.distributed as dist

    return {
        "metrics": metrics,
        "val": val,
        "train_state": state.state_dict(),
        "split": asdict(split),
        "effective_lr": effective_lr,
        "total_steps": total_steps,
        "resumed_from": resumed_from,
        "train_time_s": train_time_s,
        "log_time_s": log_time_s,
        "worker_nodes": list(worker_nodes),
        "pid": os.getpid(),
        "device": str(device),
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "timeline": timeline,
        "token_model": token_model,
    }
