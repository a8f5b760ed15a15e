"""The worker run: one DDP rank of the Ray Train worker group.

`train_loop` (Ray Train's `train_loop_per_worker`) builds a :class:`WorkerRun` and calls
`train()`, which reads top to bottom: restore → plan the epochs → fetch this rank's rows →
(auto micro-batch) → window after window (fetch → step → record → validate → checkpoint).
The data order, the normalisation rule and the checkpoint contract are in docs/design.md.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from dataclasses import asdict
from typing import Any

import numpy as np
import psutil
import ray
import ray.train
import torch
import torch.distributed as dist
from ray.train.torch import get_device, prepare_model

from rayacc.batch_plan import BatchPlan
from rayacc.config import TrainConfig
from rayacc.data.order import EpochLayout
from rayacc.data.sources import DatasetInfo
from rayacc.engine import (
    AccumulationStep,
    StepClock,
    StepCost,
    StepResult,
    TrainState,
    TrialOutOfMemory,
    all_gather_objects,
    all_reduce,
    autocast,
    autocast_dtype,
    device_peak_tflops,
    find_micro_batch_size,
    flops_per_item,
    to_device,
)
from rayacc.events import Event, MicroBatchChanged, Resized, RunStarted
from rayacc.models import build_model, loss_functions, unwrap_model
from rayacc.models.sharded import build_sharded, checkpoint_activations
from rayacc.optim import build_optimizer, build_schedule
from rayacc.quantities import (
    data_order,
    epoch_layout,
    plan_at,
    rank_seed,
    run_effective_lr,
    run_identity,
    schedule_length,
)
from rayacc.runner.checkpoint import SHARDS_DIR, read_checkpoint, shards_of, write_checkpoint
from rayacc.runner.ingest import RankReader, warm_up
from rayacc.runner.progress import Outbox

__all__ = ["REWARM_STEPS", "WorkerRun", "train_loop"]

REWARM_STEPS = 5
"""Applied steps over which the LR moves to a new peak after a resize that changed it."""


def train_loop(config: dict[str, Any]) -> dict[str, Any]:
    """Ray Train's train_loop_per_worker: the run of this rank; rank 0's return value is the
    fit's summary."""
    return WorkerRun(config).train()


class WorkerRun:
    """Everything one rank holds for its run. The LR schedule is laid out for `reference`, the
    plan at the most workers; `plan` is the plan at the worker count of this group."""

    def __init__(self, config: dict[str, Any]):
        # when this process started and when its run began: bench/startup.py's worker phases
        self.process = psutil.Process()
        self.timeline = {"process_started": self.process.create_time(), "entered": time.time()}
        self.cfg = cfg = TrainConfig.model_validate(config["cfg"])
        self.info = DatasetInfo.from_dict(config["dataset"])
        self.read_in_process = 0 < self.info.data_bytes <= cfg.data.in_process_read_max_mb * 2**20
        if not self.read_in_process:
            warm_up()
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.progress = config.get("progress")
        self.outbox = Outbox(self.progress if self.rank == 0 else None)
        self.device = self._device()
        self.fsdp = cfg.train.strategy == "fsdp"
        # dropout and anything else random: one stream per rank, the same in every run
        torch.manual_seed(rank_seed(cfg.seed, self.rank))
        self.reference = cfg.batch_plan()
        self.plan = plan_at(cfg, self.world)
        self.lr = run_effective_lr(cfg, self.plan)
        self.groups = config["groups"]
        self.source = config["source"]
        self.order = data_order(cfg, self.info, self.groups)
        self.state = TrainState()
        self.clock = StepClock()
        self.last: dict[str, Any] = {}
        self.val_metrics: dict[str, float] = {}
        self.resumed_from: int | None = None
        self.flops_per_item: float | None = None
        # the micro-batch and accumulation running now: an out-of-memory retry cuts micro-batches
        self.splits = 1
        self.micro_now, self.accum_now = self.plan.micro_batch_size, self.plan.grad_accum_steps
        self._build()
        self.timeline["built"] = time.time()

    # ------------------------------------------------------------------ the run
    def train(self) -> dict[str, Any]:
        events = self._restore()
        self._plan_epochs()
        self.total_steps = self.state.optimizer_step + sum(e[2] for e in self.epochs)
        self._open_data()
        if self.cfg.batch.auto_micro_batch:
            events.append(self._search_micro_batch())
        self._announce(events)
        for epoch, layout, n_steps, _ in self.epochs:
            self._begin_epoch(epoch)
            for s in range(n_steps):
                record = self._window(epoch, layout, s)
                self._after_window(record)
        self.outbox.flush()
        return self._summary()

    # ------------------------------------------------------------------ build and restore
    def _device(self) -> torch.device:
        # one intra-op thread per reserved CPU: more oversubscribes the cores other ranks use
        torch.set_num_threads(max(1, int(self.cfg.scaling.cpus_per_worker)))
        device = get_device()
        if self.cfg.train.allow_tf32 and device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        return device

    def _build(self) -> None:
        cfg = self.cfg
        if self.fsdp:
            self.model = build_sharded(cfg, self.info, self.device)
        else:
            module = build_model(cfg, self.info)
            checkpoint_activations(cfg, module)
            if cfg.train.compile:
                # compiled before DDP wraps it: no_sync and the gradient hooks stay outside it
                module = torch.compile(module)
            self.model = prepare_model(module)
        self.optimizer = build_optimizer(cfg, self.model.parameters(), self.lr, self.device)
        reference_layout = epoch_layout(cfg, self.order.num_train_rows, self.reference)
        # the schedule advances by samples (see _window), not by the engine's scheduler hook
        self.schedule = build_schedule(
            cfg,
            self.optimizer,
            peak_lr=self.lr,
            reference_batch=self.reference.global_batch_size,
            total_steps=schedule_length(cfg, reference_layout),
        )
        self.step = AccumulationStep(
            self.model,
            self.optimizer,
            precision=cfg.train.precision,
            max_grad_norm=cfg.optim.max_grad_norm,
            # a CUDA out-of-memory error halves the micro-batch on all ranks (auto micro-batch;
            # not sharded: a sharded rank's peers may wait in a collective it will not join)
            oom_retry=cfg.batch.auto_micro_batch and self.device.type == "cuda" and not self.fsdp,
            fsdp_grad_sync=cfg.fsdp.grad_sync,
        )
        self.loss_fn, self.count = loss_functions(
            self.info, self.model, cfg.train.loss_chunk_tokens
        )
        self.peak_tflops = device_peak_tflops(self.device, cfg.train.peak_tflops)

    def _restore(self) -> list[Event]:
        """Loads the latest checkpoint of the run, if any; a resize event when it was written
        at another worker count."""
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return []
        with checkpoint.as_directory() as folder:
            saved, _, meta = read_checkpoint(folder, map_location=self.device)
            self._check_global_batch(meta)
            shards = shards_of(folder, meta)
            if shards is not None:
                # each rank reads its rows of every tensor, whatever the size that wrote them
                from rayacc.engine.shards import load_sharded

                load_sharded(shards, self.model, self.optimizer)
            else:
                unwrap_model(self.model).load_state_dict(saved["model"])
                self.optimizer.load_state_dict(saved["optimizer"])
        self.schedule.load_state_dict(saved["schedule"])
        if self.step.scaler is not None and saved.get("scaler"):
            self.step.scaler.load_state_dict(saved["scaler"])
        self.state.load_state_dict(saved["train_state"])
        self._restore_rng(saved.get("rng"))
        self.resumed_from = self.state.optimizer_step
        # a new global batch (keep_micro_batch) moves to its LR over a short re-warmup
        self.schedule.set_peak(self.lr, rewarm_steps=REWARM_STEPS)
        if meta["num_workers"] == self.world:
            return []
        return [
            Resized(
                step=self.state.optimizer_step,
                policy=self.cfg.scaling.on_resize,
                old_workers=meta["num_workers"],
                new_workers=self.world,
                old_grad_accum_steps=meta.get("grad_accum_steps"),
                new_grad_accum_steps=self.plan.grad_accum_steps,
                old_global_batch_size=meta["global_batch_size"],
                new_global_batch_size=self.plan.global_batch_size,
                effective_lr=self.lr,
            )
        ]

    def _check_global_batch(self, meta: dict[str, Any]) -> None:
        cfg, plan = self.cfg, self.plan
        keeps_global = not cfg.scaling.elastic or cfg.scaling.on_resize == "keep_global_batch"
        if keeps_global and meta["global_batch_size"] != plan.global_batch_size:
            raise ValueError(
                f"the checkpoint was trained at global batch {meta['global_batch_size']}, this "
                f"run resolves to {plan.global_batch_size}; resume with the same "
                "batch.global_batch_size"
            )

    def _rng_state(self) -> dict[str, torch.Tensor | None]:
        cuda = self.device.type == "cuda"
        return {
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(self.device) if cuda else None,
        }

    def _restore_rng(self, saved: list[dict[str, torch.Tensor | None]] | None) -> None:
        """This rank's random state as the checkpoint left it, so a resumed run draws what an
        uninterrupted one would; after a resize (other ranks) a fresh stream of its own,
        seeded by the step."""
        if saved is None or len(saved) != self.world:
            torch.manual_seed(rank_seed(self.cfg.seed, self.rank, self.state.optimizer_step))
            return
        mine = saved[self.rank]
        torch.set_rng_state(mine["cpu"].cpu())
        if mine["cuda"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(mine["cuda"].cpu(), self.device)

    # ------------------------------------------------------------------ data
    def _plan_epochs(self) -> None:
        """Every window this rank runs from here on: per epoch, its layout over the rows left
        from the saved sample position (which a new global batch need not divide) and this
        rank's positions of each window. Which positions a rank gets does not depend on the
        micro-batch, only how they are cut."""
        cfg, state = self.cfg, self.state
        self.epochs: list[tuple[int, EpochLayout, int, tuple[np.ndarray, np.ndarray]]] = []
        steps_left = (cfg.train.max_steps or 10**12) - state.optimizer_step
        for epoch in range(state.epoch, cfg.train.epochs):
            if steps_left <= 0:
                break
            offset = state.epoch_sample_offset if epoch == state.epoch else 0
            layout = epoch_layout(cfg, self.order.num_train_rows - offset, self.plan)
            n_steps = min(layout.steps_per_epoch, steps_left)
            lo, hi = layout.rank_intervals(self.rank, n_steps)
            self.epochs.append((epoch, layout, n_steps, (lo + offset, hi + offset)))
            steps_left -= n_steps

    def _open_data(self) -> None:
        """Starts this rank's reads (runner/ingest.py) and takes its validation rows."""
        self.reader = RankReader(
            self.info, self.groups, self.order, self.source, in_process=self.read_in_process
        )
        self.reader.start(
            [self.reader.epoch_reads(e, lo, hi) for e, _, _, (lo, hi) in self.epochs],
            self.order.val_rows(self.rank, self.world),
        )
        self.val_rows = self.reader.validation()
        self.spare_batch = None
        if self.fsdp:
            # one row for the forwards a rank without validation rows of its own runs beside
            # the others: its first training row
            first = self.reader.window(self.epochs[0][0], 0) if self.epochs else self.val_rows
            self.spare_batch = first.take(np.arange(min(1, len(first))))
        self.timeline["data"] = time.time()

    def _begin_epoch(self, epoch: int) -> None:
        if epoch != self.state.epoch:
            self.state.start_epoch(epoch)
        self.clock.restart()

    # ------------------------------------------------------------------ micro-batch
    def _search_micro_batch(self) -> MicroBatchChanged:
        """`batch.micro_batch_size: auto`: the largest micro-batch that fits, the same on all
        ranks. Runs on the eager module (a compiled one would recompile for every size tried)
        with real rows of this rank; gradients are dropped and the RNG is left as it was."""
        cfg, plan, device = self.cfg, self.plan, self.device
        share = plan.samples_per_worker
        # real rows: this rank's first window (kept by the reader for the step that follows)
        rows = self.reader.window(self.epochs[0][0], 0) if self.epochs else self.val_rows
        index = np.resize(np.arange(len(rows)), share) if len(rows) else np.arange(0)

        def make_batch(n: int):
            return to_device(rows.take(index[:n]), device)

        failed = ray.get(self.progress.out_of_memory_sizes.remote()) if self.progress else []
        below = min(failed) if failed else None
        with (
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
            self._out_of_memory_recorded(),
        ):
            search = find_micro_batch_size(
                unwrap_model(self.model),
                self.loss_fn,
                make_batch,
                samples_per_worker=share,
                budget_bytes=self._memory_budget_bytes(),
                autocast_dtype=autocast_dtype(cfg.train.precision),
                optimizer_slots=2 if cfg.optim.name == "adamw" else int(cfg.optim.momentum > 0),
                below=below,
                fsdp_grad_sync=cfg.fsdp.grad_sync,
            )
        self.plan = BatchPlan(
            plan.global_batch_size, search.micro_batch_size, search.grad_accum_steps, self.world
        )
        self.micro_now, self.accum_now = self.plan.micro_batch_size, self.plan.grad_accum_steps
        self._plan_epochs()
        return MicroBatchChanged(
            step=self.state.optimizer_step,
            micro_batch_size=self.plan.micro_batch_size,
            grad_accum_steps=self.plan.grad_accum_steps,
            reason="auto search"
            + (f", below {below} (out of memory in training before)" if below else ""),
            budget_mb=search.budget_bytes / 2**20,
            trials=tuple(tuple(t) for t in search.trials),
            out_of_memory=search.out_of_memory,
        )

    def _memory_budget_bytes(self) -> int:
        if self.cfg.batch.memory_budget_mb is not None:
            return int(self.cfg.batch.memory_budget_mb * 2**20)
        total = torch.cuda.get_device_properties(self.device).total_memory
        return int(self.cfg.batch.memory_budget * total)

    @contextlib.contextmanager
    def _out_of_memory_recorded(self):
        """A sharded model's search trial that ran out of memory fails the group (see
        engine/autobatch.py); its size is recorded first, so the next search stays below."""
        try:
            yield
        except TrialOutOfMemory as exc:
            self._remember_out_of_memory(exc.micro_batch_size)
            raise

    def _remember_out_of_memory(self, size: int | None = None) -> None:
        """An out-of-memory error the step could not recover from (in a window's last
        micro-step, where peers already wait in the gradient all-reduce, or without retries):
        the group fails and restarts from the checkpoint, and its auto search then stays below
        this size instead of choosing it again."""
        if self.cfg.batch.auto_micro_batch and self.progress is not None:
            # waited for: the process is about to fail
            ray.get(self.progress.remember_out_of_memory.remote(size or self.micro_now), timeout=30)

    def _note_splits(self, result: StepResult) -> None:
        """An out-of-memory retry cut the micro-batches: say so once, from the next step on."""
        if result.micro_batch_splits == self.splits:
            return
        self.splits = result.micro_batch_splits
        self.micro_now = math.ceil(self.plan.micro_batch_size / self.splits)
        self.accum_now = self.plan.grad_accum_steps * self.splits
        self.outbox.send(
            MicroBatchChanged(
                step=self.state.optimizer_step,
                micro_batch_size=self.micro_now,
                grad_accum_steps=self.accum_now,
                reason="out of memory",
            )
        )

    # ------------------------------------------------------------------ one window
    def _announce(self, events: list[Event]) -> None:
        first_layout = self.epochs[0][1] if self.epochs else None
        layout = first_layout or epoch_layout(self.cfg, self.order.num_train_rows, self.plan)
        self.outbox.send(
            RunStarted(
                step=self.state.optimizer_step,
                total_steps=self.total_steps,
                resumed_from=self.resumed_from,
                layout=layout.describe(),
                plan=asdict(self.plan),
                effective_lr=self.lr,
            )
        )
        for event in events:
            self.outbox.send(event)
        self.outbox.flush()

    def _window(self, epoch: int, layout: EpochLayout, s: int) -> dict[str, Any]:
        """Fetch this rank's micro-batches of window `s`, run the accumulation step, advance
        the schedule and the train state; returns the step's record."""
        t_data = time.perf_counter()
        sizes = [len(part) for part in layout.rank_window(s, self.rank).micro_batches]
        rows = self.reader.window(epoch, s)
        host = rows.take_split(np.arange(len(rows)), sizes)
        local_items = sum(self.count(mb) for mb in host)  # on the host: no GPU sync
        micro_batches = [to_device(mb, self.device, non_blocking=True) for mb in host]
        data_s = time.perf_counter() - t_data
        if self.flops_per_item is None and micro_batches:
            first = next(iter(micro_batches[0].values()))
            shape = tuple(first.shape[1:])
            self.flops_per_item = flops_per_item(unwrap_model(self.model), shape) or 0.0
        try:
            result = self.step(micro_batches, self.loss_fn, self.count, local_items=local_items)
        except torch.OutOfMemoryError:
            self._remember_out_of_memory()
            raise
        self._note_splits(result)
        if not result.skipped:
            self.schedule.step(result.samples)
        self.state.advance(samples=result.samples, items=result.items, skipped=result.skipped)
        if s == layout.steps_per_epoch - 1:
            self.state.start_epoch(epoch + 1)
        if "first_step" not in self.timeline:
            self.timeline["first_step"] = time.time()
        return self._record(result, epoch, self.clock.lap(), data_s)

    def _record(self, result: StepResult, epoch: int, wall: float, data_s: float) -> dict[str, Any]:
        record = {
            "step": self.state.optimizer_step,
            "train/loss": result.loss,
            "train/lr": result.lr,
            "train/grad_norm": result.grad_norm,
            "train/items": result.items,
            "train/samples": result.samples,
            "train/samples_per_s": result.samples / wall if wall > 0 else 0.0,
            "train/skipped_steps": self.state.skipped_steps,
            "scaling/num_workers": self.world,
            "scaling/grad_accum_steps": self.accum_now,
            "scaling/micro_batch_size": self.micro_now,
            "scaling/global_batch_size": self.plan.global_batch_size,
            "comm/allreduce_calls": result.allreduce_calls,
            "comm/reduce_scatter_calls": result.reduce_scatter_calls,
            "data/rows_read": self.reader.rows_read,
            "comm/sync_time_frac": result.sync_time_frac,
            "mem/peak_mb": result.peak_memory_mb,
            "mem/rss_mb": self.process.memory_info().rss / 2**20,
            "epoch": epoch,
        }
        cost = StepCost(
            wall_s=wall,
            data_s=data_s,
            items=result.items,
            world_size=self.world,
            flops_per_item=self.flops_per_item or None,
            peak_tflops=self.peak_tflops,
        )
        record.update(cost.metrics(token_items=self.info.format == "tokens"))
        return record

    def _after_window(self, record: dict[str, Any]) -> None:
        """Validation and checkpoints when due; the record goes to the driver. Validation and
        checkpoints are not step time; handing the record over is."""
        step = self.state.optimizer_step
        is_last = step >= self.total_steps
        every_val, every_ckpt = (
            self.cfg.train.val_every_steps,
            self.cfg.train.checkpoint_every_steps,
        )
        if len(self.order.val_units) and (is_last or (every_val and step % every_val == 0)):
            with self.clock.paused():
                self.val_metrics = self._validate()
            record.update(self.val_metrics)
        self.last = record
        self.outbox.send(dict(record))
        if is_last or (every_ckpt and step % every_ckpt == 0):
            with self.clock.paused():
                # records up to a checkpoint are never replayed after a restart: hand them over
                self.outbox.flush()
                self._checkpoint(dict(record))

    # ------------------------------------------------------------------ validate, checkpoint
    @torch.no_grad()
    def _validate(self) -> dict[str, float]:
        """Mean item loss (and accuracy) over the validation rows of all ranks."""
        # no DDP forward: ranks may run different numbers of batches here (and the eager
        # module: validation shapes would make a compiled one recompile)
        inner = unwrap_model(self.model)
        was_training = inner.training
        inner.eval()
        totals = torch.zeros(3, dtype=torch.float64)
        classification = self.info.format == "classification"
        batch_size = 2 * self.plan.micro_batch_size
        n_batches = math.ceil(len(self.val_rows) / batch_size)
        if self.fsdp:
            # every forward of a sharded model gathers parameters with the other ranks: all
            # ranks run as many batches as the one with the most (the extra ones uncounted)
            n_batches = int(all_reduce(torch.tensor([float(n_batches)]), op="max").item())
        for b in range(n_batches):
            start = b * batch_size
            own = start < len(self.val_rows)
            index = np.arange(start, min(start + batch_size, len(self.val_rows)))
            rows = self.val_rows.take(index) if own else self.spare_batch
            mb = to_device(rows, self.device)
            with autocast(self.device.type, self.cfg.train.precision):
                losses = self.loss_fn(inner, mb)
                correct = (inner(mb["features"]).argmax(-1) == mb["label"]) if classification else 0
            if own:
                totals[0] += float(losses.float().sum())
                totals[1] += self.count(mb)
                totals[2] += float(correct.sum()) if classification else 0.0
        inner.train(was_training)
        loss_sum, items, correct = all_reduce(totals).tolist()
        out = {"val/loss": loss_sum / items if items else math.nan}
        if classification:
            out["val/accuracy"] = correct / items if items else math.nan
        return out

    def _checkpoint(self, metrics: dict[str, Any]) -> None:
        """Every rank reports (a barrier). Rank 0 writes the folder, with every rank's random
        state; under FSDP every rank first writes its shards into its part of the folder (Ray
        Train merges the parts into one checkpoint folder in the run's storage)."""
        rng = all_gather_objects(self._rng_state())
        with tempfile.TemporaryDirectory() as tmp:
            whole: dict[str, Any] = {}
            if self.fsdp:
                from rayacc.engine.shards import save_sharded

                save_sharded(os.path.join(tmp, SHARDS_DIR), self.model, self.optimizer)
            elif self.rank == 0:
                whole["model"] = unwrap_model(self.model).state_dict()
                whole["optimizer"] = self.optimizer.state_dict()
            if self.rank == 0:
                self._write_checkpoint(tmp, whole, rng)
            has_part = self.rank == 0 or self.fsdp
            ray.train.report(
                metrics,
                checkpoint=ray.train.Checkpoint.from_directory(tmp) if has_part else None,
                checkpoint_dir_name=f"checkpoint_step{self.state.optimizer_step:08d}",
            )

    def _write_checkpoint(self, folder: str, whole: dict[str, Any], rng: list) -> None:
        write_checkpoint(
            folder,
            state={
                **whole,
                "schedule": self.schedule.state_dict(),
                "scaler": self.step.scaler.state_dict() if self.step.scaler else None,
                "train_state": self.state.state_dict(),
                "rng": rng,
            },
            config=self.cfg.model_dump(mode="json"),
            dataset=self.info.to_dict(),
            meta={
                "optimizer_step": self.state.optimizer_step,
                "global_batch_size": self.plan.global_batch_size,
                "grad_accum_steps": self.plan.grad_accum_steps,
                "num_workers": self.world,
                "epoch": self.state.epoch,
                "epoch_sample_offset": self.state.epoch_sample_offset,
                "identity": run_identity(self.cfg, self.info),
                "shards": SHARDS_DIR if self.fsdp else None,
            },
        )

    def _summary(self) -> dict[str, Any]:
        worker_nodes = all_gather_objects(ray.get_runtime_context().get_node_id())
        self.timeline["finished"] = time.time()
        return {
            "metrics": self.last,
            "val": self.val_metrics,
            "train_state": self.state.state_dict(),
            "plan": asdict(self.plan),
            "effective_lr": self.lr,
            "total_steps": self.total_steps,
            "resumed_from": self.resumed_from,
            "train_time_s": self.clock.total_s,
            "log_time_s": self.outbox.cost_s,
            "worker_nodes": worker_nodes,
            "pid": os.getpid(),
            "device": str(self.device),
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "timeline": self.timeline,
        }
