"""train_loop_per_worker: one DDP rank, the engine's accumulation step over its share of each
window, per-step records, validation and checkpoints at window boundaries."""

from __future__ import annotations

import math
import os
import tempfile
import time
from dataclasses import asdict
from typing import Any

import numpy as np
import ray
import ray.train
import torch
import torch.distributed as dist
from ray.train.torch import get_device, prepare_model

from rayacc.batch_plan import BatchPlan, plan_for_workers
from rayacc.config import TrainConfig
from rayacc.data.order import EpochLayout, epoch_order, split_train_val
from rayacc.data.sources import DatasetInfo
from rayacc.engine import (
    AccumulationStep,
    SampleSchedule,
    StepCost,
    TrainState,
    device_peak_tflops,
    effective_lr,
    find_micro_batch_size,
    flops_per_item,
)
from rayacc.models import build_model, loss_functions, unwrap_model
from rayacc.runner.checkpoint import read_checkpoint, write_checkpoint
from rayacc.runner.ingest import LocalRows, fetch_rows

__all__ = ["REWARM_STEPS", "total_optimizer_steps", "train_loop"]

REWARM_STEPS = 5
"""Applied steps over which the LR moves to a new peak after a resize that changed it."""


def total_optimizer_steps(cfg: TrainConfig, layout: EpochLayout) -> int:
    by_epochs = cfg.train.epochs * layout.steps_per_epoch
    return min(cfg.train.max_steps, by_epochs) if cfg.train.max_steps else by_epochs


def _optimizer(
    cfg: TrainConfig, model: torch.nn.Module, lr: float, device: torch.device
) -> torch.optim.Optimizer:
    o = cfg.optim
    # one kernel per parameter instead of several per tensor: PyTorch's fused kernels exist
    # for CPU and CUDA (on a small CPU model AdamW's step takes a third of the per-tensor loop)
    fused = o.fused if o.fused is not None else device.type in ("cpu", "cuda")
    if o.name == "sgd":
        return torch.optim.SGD(
            model.parameters(),
            lr=lr,
            momentum=o.momentum,
            weight_decay=o.weight_decay,
            fused=fused or None,
        )
    return torch.optim.AdamW(
        model.parameters(), lr=lr, betas=o.betas, weight_decay=o.weight_decay, fused=fused or None
    )


def _memory_budget_bytes(cfg: TrainConfig, device: torch.device) -> int:
    if cfg.batch.memory_budget_mb is not None:
        return int(cfg.batch.memory_budget_mb * 2**20)
    total = torch.cuda.get_device_properties(device).total_memory
    return int(cfg.batch.memory_budget * total)


def _search_micro_batch(cfg, model, loss_fn, rows, ids, plan, device) -> tuple[BatchPlan, dict]:
    """`batch.micro_batch_size: auto`: the largest micro-batch that fits, the same on all ranks.
    Runs on the eager module (a compiled one would recompile for every size tried) with real
    rows of this rank; gradients are dropped and the RNG is left as it was."""
    share = plan.samples_per_worker
    index = np.resize(ids, share) if len(ids) else ids

    def make_batch(n: int):
        return {k: v.to(device) for k, v in rows.take(index[:n]).items()}

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
    inner = unwrap_model(model)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        search = find_micro_batch_size(
            inner,
            loss_fn,
            make_batch,
            samples_per_worker=share,
            budget_bytes=_memory_budget_bytes(cfg, device),
            autocast_dtype=dtype,
            optimizer_slots=2 if cfg.optim.name == "adamw" else int(cfg.optim.momentum > 0),
        )
    chosen = BatchPlan(
        plan.global_batch_size, search.micro_batch_size, search.grad_accum_steps, plan.num_workers
    )
    event = {
        "event": "micro_batch",
        "reason": "auto search",
        "micro_batch_size": chosen.micro_batch_size,
        "grad_accum_steps": chosen.grad_accum_steps,
        "budget_mb": search.budget_bytes / 2**20,
        "trials": search.trials,
    }
    return chosen, event


@torch.no_grad()
def _validate(
    model,
    rows: LocalRows,
    index: np.ndarray,
    info: DatasetInfo,
    loss_fn,
    count,
    device,
    batch_size: int,
    precision: str,
) -> dict[str, float]:
    """Mean item loss (and accuracy) over the validation rows of all ranks."""
    # no DDP forward: ranks may run different numbers of batches here (and the eager module:
    # validation shapes would make a compiled one recompile)
    inner = unwrap_model(model)
    was_training = inner.training
    inner.eval()
    totals = torch.zeros(3, dtype=torch.float64)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    for start in range(0, len(index), batch_size):
        mb = {k: v.to(device) for k, v in rows.take(index[start : start + batch_size]).items()}
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            losses = loss_fn(inner, mb)
            if info.format == "classification":
                correct = (inner(mb["features"]).argmax(-1) == mb["label"]).sum()
                totals[2] += float(correct)
        totals[0] += float(losses.float().sum())
        totals[1] += count(mb)
    inner.train(was_training)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    loss_sum, items, correct = totals.tolist()
    out = {"val/loss": loss_sum / items if items else math.nan}
    if info.format == "classification":
        out["val/accuracy"] = correct / items if items else math.nan
    return out


class _Outbox:
    """Rank 0's records for the driver, sent in batches at most every `interval_s`: one actor
    call costs about a millisecond, too much to pay on every step of a fast model."""

    def __init__(self, progress, interval_s: float = 0.5):
        self.progress = progress
        self.interval_s = interval_s
        self.pending: list[dict[str, Any]] = []
        self.last_sent = time.perf_counter()
        self.cost_s = 0.0

    def send(self, record: dict[str, Any]) -> None:
        if self.progress is None:
            return
        self.pending.append(record)
        if time.perf_counter() - self.last_sent >= self.interval_s:
            self.flush()

    def flush(self) -> None:
        if self.progress is None or not self.pending:
            return
        t = time.perf_counter()
        self.progress.push.remote(self.pending)
        self.pending = []
        self.last_sent = time.perf_counter()
        self.cost_s += self.last_sent - t


def train_loop(config: dict[str, Any]) -> dict[str, Any]:
    cfg = TrainConfig.model_validate(config["cfg"])
    info = DatasetInfo.from_dict(config["dataset"])
    progress = config.get("progress")
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    # one intra-op thread per reserved CPU: more oversubscribes the cores other ranks use
    torch.set_num_threads(max(1, int(cfg.scaling.cpus_per_worker)))
    device = get_device()
    if cfg.train.allow_tf32 and device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    # the plan at the worker count Ray gave this attempt; `reference` is the plan at the most
    # workers, which the LR schedule is laid out for
    reference = cfg.batch_plan()
    if cfg.scaling.elastic:
        plan = plan_for_workers(reference, world, cfg.scaling.on_resize)
    else:
        plan = cfg.batch_plan(num_workers=world)
    lr = effective_lr(
        cfg.optim.lr, plan.global_batch_size, cfg.optim.base_batch_size, cfg.optim.lr_scaling
    )
    train_ids, val_ids = split_train_val(info.num_rows, cfg.data.val_fraction, cfg.seed)

    def layout_of(rows: int) -> EpochLayout:
        return EpochLayout(
            rows, plan.global_batch_size, plan.micro_batch_size, world, cfg.data.last_window
        )

    reference_layout = EpochLayout(
        len(train_ids),
        reference.global_batch_size,
        reference.micro_batch_size,
        reference.num_workers,
        cfg.data.last_window,
    )
    module = build_model(cfg, info)
    if cfg.train.compile:
        # compiled before DDP wraps it, so no_sync and the gradient hooks stay outside the graph
        module = torch.compile(module)
    model = prepare_model(module)
    optimizer = _optimizer(cfg, model, lr, device)
    schedule = SampleSchedule(
        optimizer,
        peak_lr=lr,
        reference_batch=reference.global_batch_size,
        warmup_steps=cfg.optim.warmup_steps,
        total_steps=total_optimizer_steps(cfg, reference_layout),
        schedule=cfg.optim.schedule,
        min_lr_ratio=cfg.optim.min_lr_ratio,
    )
    # the schedule advances by samples (below), not by the engine's per-step scheduler hook
    step = AccumulationStep(
        model,
        optimizer,
        precision=cfg.train.precision,
        max_grad_norm=cfg.optim.max_grad_norm,
        # a CUDA out-of-memory error halves the micro-batch on all ranks (auto micro-batch)
        oom_retry=cfg.batch.auto_micro_batch and device.type == "cuda",
    )
    state = TrainState()

    resumed_from = None
    resize: dict[str, Any] | None = None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            saved, _, meta = read_checkpoint(folder, map_location=device)
        keeps_global = not cfg.scaling.elastic or cfg.scaling.on_resize == "keep_global_batch"
        if keeps_global and meta["global_batch_size"] != plan.global_batch_size:
            raise ValueError(
                f"the checkpoint was trained at global batch {meta['global_batch_size']}, this "
                f"run resolves to {plan.global_batch_size}; resume with the same "
                "batch.global_batch_size"
            )
        unwrap_model(model).load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["schedule"])
        if step.scaler is not None and saved.get("scaler"):
            step.scaler.load_state_dict(saved["scaler"])
        state.load_state_dict(saved["train_state"])
        resumed_from = state.optimizer_step
        if meta["num_workers"] != world:
            resize = {
                "event": "resize",
                "step": state.optimizer_step,
                "policy": cfg.scaling.on_resize,
                "old_workers": meta["num_workers"],
                "new_workers": world,
                "old_grad_accum_steps": meta.get("grad_accum_steps"),
                "new_grad_accum_steps": plan.grad_accum_steps,
                "old_global_batch_size": meta["global_batch_size"],
                "new_global_batch_size": plan.global_batch_size,
                "effective_lr": lr,
            }
        # a new global batch (keep_micro_batch) moves to its LR over a short re-warmup
        schedule.set_peak(lr, rewarm_steps=REWARM_STEPS)

    loss_fn, count = loss_functions(info, model, cfg.train.loss_chunk_tokens)
    shard = ray.train.get_dataset_shard("train")
    val_share = np.array_split(val_ids, world)[rank]

    last: dict[str, Any] = {}
    val_metrics: dict[str, float] = {}
    t_prev = time.perf_counter()
    t_train = 0.0

    def checkpoint_and_report(metrics: dict[str, Any]) -> None:
        if rank != 0:
            ray.train.report(metrics, checkpoint=None)
            return
        with tempfile.TemporaryDirectory() as tmp:
            write_checkpoint(
                tmp,
                state={
                    "model": unwrap_model(model).state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "schedule": schedule.state_dict(),
                    "scaler": step.scaler.state_dict() if step.scaler is not None else None,
                    "train_state": state.state_dict(),
                },
                config=cfg.model_dump(mode="json"),
                dataset=info.to_dict(),
                meta={
                    "optimizer_step": state.optimizer_step,
                    "global_batch_size": plan.global_batch_size,
                    "grad_accum_steps": plan.grad_accum_steps,
                    "num_workers": world,
                    "epoch": state.epoch,
                    "epoch_sample_offset": state.epoch_sample_offset,
                },
            )
            ray.train.report(
                metrics,
                checkpoint=ray.train.Checkpoint.from_directory(tmp),
                checkpoint_dir_name=f"checkpoint_step{state.optimizer_step:08d}",
            )

    def plan_epochs() -> list[tuple[int, EpochLayout, int, np.ndarray]]:
        """Every window this rank runs from here on: per epoch, its layout over the rows left
        from the saved sample position (which a new global batch need not divide). Which rows
        a rank gets does not depend on the micro-batch, only how they are cut."""
        epochs = []
        steps_left = (cfg.train.max_steps or 10**12) - state.optimizer_step
        for epoch in range(state.epoch, cfg.train.epochs):
            if steps_left <= 0:
                break
            offset = state.epoch_sample_offset if epoch == state.epoch else 0
            lay = layout_of(len(train_ids) - offset)
            n_steps = min(lay.steps_per_epoch, steps_left)
            order = epoch_order(train_ids, epoch, cfg.seed, cfg.data.shuffle)
            ids = order[offset + lay.rank_positions(0, rank, n_steps)]
            epochs.append((epoch, lay, n_steps, ids))
            steps_left -= n_steps
        return epochs

    epochs = plan_epochs()
    total_steps = state.optimizer_step + sum(e[2] for e in epochs)
    needed = np.unique(np.concatenate([e[3] for e in epochs] + [val_share]))
    rows = fetch_rows(shard, info, needed)
    val_index = np.searchsorted(needed, val_share)
    micro_event = None
    if cfg.batch.auto_micro_batch:
        first_ids = np.searchsorted(needed, epochs[0][3]) if epochs else np.arange(len(needed))
        plan, micro_event = _search_micro_batch(cfg, model, loss_fn, rows, first_ids, plan, device)
        micro_event["step"] = state.optimizer_step
        epochs = plan_epochs()
    val_batch = 2 * plan.micro_batch_size
    peak_tflops = device_peak_tflops(device, cfg.train.peak_tflops)
    fpi: float | None = None

    outbox = _Outbox(progress if rank == 0 else None)
    outbox.send(
        {
            "event": "start",
            "step": state.optimizer_step,
            "total_steps": total_steps,
            "resumed_from": resumed_from,
            "layout": (epochs[0][1] if epochs else layout_of(len(train_ids))).describe(),
            "plan": asdict(plan),
            "effective_lr": lr,
        }
    )
    if resize is not None:
        outbox.send(resize)
    if micro_event is not None:
        outbox.send(micro_event)
    outbox.flush()
    # the micro-batch and accumulation running now: an out-of-memory retry cuts micro-batches
    splits = 1
    micro_now, accum_now = plan.micro_batch_size, plan.grad_accum_steps

    for epoch, lay, n_steps, ids in epochs:
        if epoch != state.epoch:
            state.start_epoch(epoch)
        local = np.searchsorted(needed, ids)
        cursor = 0
        t_prev = time.perf_counter()
        for s in range(n_steps):
            t_data = time.perf_counter()
            sizes = [len(part) for part in lay.rank_window(s, rank).micro_batches]
            window_rows = sum(sizes)
            host = rows.take_split(local[cursor : cursor + window_rows], sizes)
            cursor += window_rows
            local_items = sum(count(mb) for mb in host)  # on the host: no GPU sync
            micro_batches = [
                {k: v.to(device, non_blocking=True) for k, v in mb.items()} for mb in host
            ]
            data_s = time.perf_counter() - t_data
            if fpi is None and micro_batches:
                first = next(iter(micro_batches[0].values()))
                fpi = flops_per_item(unwrap_model(model), tuple(first.shape[1:])) or 0.0
            result = step(micro_batches, loss_fn, count, local_items=local_items)
            if result.micro_batch_splits != splits:
                splits = result.micro_batch_splits
                micro_now = math.ceil(plan.micro_batch_size / splits)
                accum_now = plan.grad_accum_steps * splits
                outbox.send(
                    {
                        "event": "micro_batch",
                        "reason": "out of memory",
                        "step": state.optimizer_step + 1,
                        "micro_batch_size": micro_now,
                        "grad_accum_steps": accum_now,
                    }
                )
            if not result.skipped:
                schedule.step(result.samples)
            state.advance(samples=result.samples, items=result.items, skipped=result.skipped)
            if s == lay.steps_per_epoch - 1:
                state.start_epoch(epoch + 1)
            now = time.perf_counter()
            wall = now - t_prev
            t_prev = now
            t_train += wall
            last = {
                "step": state.optimizer_step,
                "train/loss": result.loss,
                "train/lr": result.lr,
                "train/grad_norm": result.grad_norm,
                "train/items": result.items,
                "train/samples": result.samples,
                "train/samples_per_s": result.samples / wall if wall > 0 else 0.0,
                "train/skipped_steps": state.skipped_steps,
                "scaling/num_workers": world,
                "scaling/grad_accum_steps": accum_now,
                "scaling/micro_batch_size": micro_now,
                "scaling/global_batch_size": plan.global_batch_size,
                "comm/allreduce_calls": result.allreduce_calls,
                "comm/sync_time_frac": result.sync_time_frac,
                "mem/peak_mb": result.peak_memory_mb,
                "epoch": epoch,
            }
            cost = StepCost(
                wall_s=wall,
                data_s=data_s,
                items=result.items,
                world_size=world,
                flops_per_item=fpi or None,
                peak_tflops=peak_tflops,
            )
            last.update(cost.metrics(token_items=info.format == "tokens"))
            is_last = state.optimizer_step >= total_steps
            # validation and checkpoints are not step time; handing the record over is
            t_pause = time.perf_counter()
            every_val = cfg.train.val_every_steps
            if len(val_ids) and (is_last or (every_val and state.optimizer_step % every_val == 0)):
                val_metrics = _validate(
                    model,
                    rows,
                    val_index,
                    info,
                    loss_fn,
                    count,
                    device,
                    val_batch,
                    cfg.train.precision,
                )
                last.update(val_metrics)
            paused = time.perf_counter() - t_pause
            outbox.send(dict(last))
            every_ckpt = cfg.train.checkpoint_every_steps
            if is_last or (every_ckpt and state.optimizer_step % every_ckpt == 0):
                t_ckpt = time.perf_counter()
                # records up to a checkpoint are never replayed after a restart: hand them over
                outbox.flush()
                checkpoint_and_report(dict(last))
                paused += time.perf_counter() - t_ckpt
            t_prev += paused

    outbox.flush()
    node_id = ray.get_runtime_context().get_node_id()
    worker_nodes = [node_id]
    if dist.is_initialized() and world > 1:
        worker_nodes = [None] * world
        dist.all_gather_object(worker_nodes, node_id)
    return {
        "metrics": last,
        "val": val_metrics,
        "train_state": state.state_dict(),
        "plan": asdict(plan),
        "effective_lr": lr,
        "total_steps": total_steps,
        "resumed_from": resumed_from,
        "train_time_s": t_train,
        "log_time_s": outbox.cost_s,
        "worker_nodes": worker_nodes,
        "pid": os.getpid(),
    }
