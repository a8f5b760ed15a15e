"""The planner on the real worker group: the profile (at the most workers), then a few windows of
each chosen candidate, one Ray Train group per worker count.

Out of memory is probed as the auto search does (engine/autobatch.py): the probe's verdict is
agreed by every rank before anything else runs; a sharded model's probe that runs out of memory
fails the group (a peer may wait in a gather this rank never joins), and the ledger, which
outlives the group, says which candidate did: it is marked, and a new group goes on with the
rest. Rank 0's clock decides, for every rank at once, when the time budget is spent."""

from __future__ import annotations

import gc
import statistics
import time
import uuid
from typing import Any

import numpy as np
import ray
import torch

from rayacc.config import TrainConfig
from rayacc.config.batch_split import BatchSplit
from rayacc.data.sources import DatasetInfo
from rayacc.engine import TrialOutOfMemory, autocast_dtype, to_device
from rayacc.engine.autobatch import OUT_OF_MEMORY, measure_step_bytes
from rayacc.engine.parallel import strategy_class
from rayacc.optim import optimizer_slots
from rayacc.planner.candidates import Candidate, strategy_modes, with_candidate
from rayacc.planner.prior import predict
from rayacc.planner.profile import Profile, largest_over_ranks, measure_profile, time_windows
from rayacc.rank.build import build_rank

__all__ = ["CalibrationGroup", "Ledger", "calibration_loop", "sample_rows"]


def sample_rows(info: DatasetInfo, n: int):
    """The first `n` rows of the data (the calibration's windows repeat them): one global
    batch, read from the row groups that hold them by the reader the rest of rayacc uses (a
    file or a folder of files, local or a URI), never the whole dataset."""
    from rayacc.data.rows import read_local_rows
    from rayacc.data.sources import row_groups

    return read_local_rows(info, row_groups(info.path), np.arange(min(n, info.num_rows)))


@ray.remote(num_cpus=0)
class Ledger:
    """What the groups measured (outlives a failed group) and the candidate being measured."""

    def __init__(self) -> None:
        self.results: dict[str, Any] = {}
        self.current: str | None = None

    def trying(self, key: str) -> None:
        self.current = key

    def done(self, key: str, result: Any) -> None:
        self.results[key] = result
        self.current = None

    def read(self) -> tuple[dict[str, Any], str | None]:
        return self.results, self.current


def measure_candidate(
    cfg: TrainConfig,
    info: DatasetInfo,
    rows,
    c: Candidate,
    *,
    rank: int,
    device,
    budget: float,
    min_timed_s: float = 1.0,
) -> dict[str, Any]:
    """Probe, then time windows of `c` on this group (every rank calls it)."""
    cc = with_candidate(cfg, c)
    # the candidate's own split: the fixed costs' windows of 1 and 4 micro-steps are not the
    # job's global batch (DeepSpeed's engine is configured with the split it runs)
    split = BatchSplit(
        c.global_batch_size,
        c.micro_batch_size,
        c.grad_accum_steps,
        c.workers,
        tensor_parallel=c.tensor_parallel,
        pipeline_parallel=c.pipeline_parallel,
    )
    parts = build_rank(cc, info, device, cfg.optim.lr, split=split)
    strategy, step, loss_fn, count = parts.strategy, parts.accumulate, parts.loss_fn, parts.count
    m = c.micro_batch_size
    if strategy.data_group is not None:
        # a tensor-parallel group or a pipeline reads its data-parallel rank's rows
        rank = torch.distributed.get_rank(strategy.data_group)
    index = np.resize(np.arange(len(rows)), m * (rank + 1))[rank * m :]
    try:
        used = measure_step_bytes(
            strategy.unwrapped(),
            loss_fn,
            to_device(rows.take(index), device),
            autocast_dtype=autocast_dtype(cc.train.precision),
            optimizer_slots=optimizer_slots(cc.optim),
            strategy=strategy,
        )
        if used == OUT_OF_MEMORY and strategy.contract.lockstep:
            # not agreed on: a peer may wait in this probe's gathers
            raise TrialOutOfMemory(m)
        # one verdict for all: the largest use, and over budget if any rank's budget is
        # exceeded (budgets differ where devices or ranks per node do)
        over = bool(budget) and used > budget
        used, over = largest_over_ranks([float(used), float(over)])
        if used >= OUT_OF_MEMORY:
            return {"status": "out of memory"}
        if over:
            return {"status": "over budget", "memory_bytes": used}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = time_windows(
            step,
            loss_fn,
            count,
            rows,
            rank=rank,
            micro=m,
            accum=c.grad_accum_steps,
            device=device,
            min_timed_s=min_timed_s,
        )
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        step_s, memory = largest_over_ranks([statistics.median(times), float(max(used, peak))])
        return {"status": "measured", "memory_bytes": memory, "step_s": step_s}
    finally:
        # every reference to the candidate's model and optimizer, before the next one's
        del parts, strategy, step, loss_fn, count
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


ACCUM_LEVER = 4
"""Micro-steps of the longer window the fixed costs are measured with."""


def measure_overheads(
    cfg: TrainConfig, info: DatasetInfo, rows, profile: Profile, *, rank: int, device, world: int
) -> dict[str, list[float]]:
    """Each strategy's fixed cost per window and per micro-step: real windows of 1 and 4
    micro-steps at the profile's smallest micro-batch, less what the prior counts in them
    (4, not 2: the per-micro-step cost is the difference of two noisy times, divided by 3)."""
    bf16 = cfg.train.precision == "bf16" and cfg.fsdp.mixed_precision
    # without checkpointing when it fits; a model that fits only with it, with it
    setting = next(iter(sorted(profile.compute_s, key=lambda k: k != "none")), None)
    if setting is None:  # nothing fitted: every candidate is pruned
        return {}
    ac = int(setting) if setting.isdigit() else setting
    m = profile.compute_s[setting].sizes[0]
    out: dict[str, list[float]] = {}
    for mode in strategy_modes(cfg.train.strategy):
        if world < strategy_class(mode["strategy"]).min_workers:
            continue
        residual = []
        for a in (1, ACCUM_LEVER):
            c = Candidate(world, m, a, checkpointing=ac, **mode)
            got = measure_candidate(
                cfg, info, rows, c, rank=rank, device=device, budget=0, min_timed_s=0.5
            )
            if got["status"] != "measured":
                break
            counted = predict(
                c, profile, reshard_after_forward=cfg.fsdp.reshard_after_forward, bf16_gathers=bf16
            )
            residual.append(got["step_s"] - counted.step_s)
        if len(residual) == 2:
            each = (residual[1] - residual[0]) / (ACCUM_LEVER - 1)
            once = residual[0] - each
            out[c.overhead_label] = [max(once, 0.0), max(each, 0.0)]
    return out


def calibration_loop(config: dict[str, Any]) -> None:
    """Ray Train's train_loop_per_worker of a calibration group: the profile, or candidates."""
    from ray.train.torch import get_device

    cfg = TrainConfig.model_validate(config["cfg"])
    info = DatasetInfo.from_dict(config["dataset"])
    rows, ledger = config["rows"], config["ledger"]
    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    torch.set_num_threads(max(1, int(cfg.scaling.cpus_per_worker)))
    device = get_device()
    budget = config["budget_bytes"] or _device_budget(cfg, device, ctx)
    world = ctx.get_world_size()
    if config["mode"] == "profile":
        profile = measure_profile(
            cfg,
            info,
            rows,
            sizes=config["sizes"],
            checkpointings=config["checkpointings"],
            device=device,
            rank=rank,
            memory_bytes=int(budget),
        )
        profile.overheads = measure_overheads(
            cfg, info, rows, profile, rank=rank, device=device, world=world
        )
        if rank == 0:
            ray.get(ledger.done.remote(f"profile-{world}", profile.to_dict()))
        return
    for key, spec in config["candidates"]:
        # rank 0's clock, every rank's decision
        (late,) = largest_over_ranks([float(rank == 0 and time.time() > config["deadline"])])
        if late:
            return
        if rank == 0:
            ray.get(ledger.trying.remote(key))
        result = measure_candidate(
            cfg, info, rows, Candidate.from_dict(spec), rank=rank, device=device, budget=budget
        )
        if rank == 0:
            ray.get(ledger.done.remote(key, result))


def _device_budget(cfg: TrainConfig, device, ctx) -> float:
    """The memory one rank may plan for: `batch.memory_budget` of the GPU, or of this node's
    RAM shared by the ranks on it."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return cfg.batch.memory_budget * total
    import psutil

    return cfg.batch.memory_budget * psutil.virtual_memory().total / ctx.get_local_world_size()


class CalibrationGroup:
    """Runs calibration groups for one search: their shared ledger, storage and settings."""

    def __init__(self, cfg: TrainConfig, info: DatasetInfo, rows, storage: str):
        self.cfg, self.info, self.rows, self.storage = cfg, info, rows, storage
        self.ledger = Ledger.remote()
        self.budget_bytes = (
            cfg.batch.memory_budget_mb * 2**20 if cfg.batch.memory_budget_mb else None
        )
        self.groups_started = 0
        self.run_names: list[str] = []

    def _fit(self, workers: int, **config: Any) -> str | None:
        """One group; the error's text when it failed."""
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        s = self.cfg.scaling
        name = f"rayacc-plan-{uuid.uuid4().hex[:8]}"
        self.run_names.append(name)
        trainer = TorchTrainer(
            calibration_loop,
            train_loop_config={
                "cfg": self.cfg.model_dump(mode="json"),
                "dataset": self.info.to_dict(),
                "rows": self.rows,
                "ledger": self.ledger,
                "budget_bytes": self.budget_bytes,
                **config,
            },
            scaling_config=ScalingConfig(
                num_workers=workers,
                use_gpu=s.use_gpu,
                resources_per_worker=s.resources_per_worker(),
                placement_strategy=s.placement_strategy,
            ),
            run_config=RunConfig(
                name=name,
                storage_path=self.storage,
                failure_config=FailureConfig(max_failures=0),
            ),
        )
        self.groups_started += 1
        try:
            trainer.fit()
        except Exception as exc:  # a worker's error: the ledger says which candidate
            return str(exc)
        return None

    def profile(self, workers: int, sizes: list[int], checkpointings: list) -> Profile:
        """The profile measured on a group of `workers`."""
        error = self._fit(workers, mode="profile", sizes=sizes, checkpointings=checkpointings)
        results, _ = ray.get(self.ledger.read.remote())
        if f"profile-{workers}" not in results:
            raise RuntimeError(f"the planner's profile on {workers} worker(s) failed: {error}")
        return Profile.from_dict(results[f"profile-{workers}"])

    def measure(self, workers: int, todo: list[tuple[str, Candidate]], deadline: float):
        """Measures `todo` (all of `workers` workers) until done or the deadline; a group that
        fails in a candidate's probe is replaced by one that goes on after it."""
        while todo and time.time() < deadline:
            error = self._fit(
                workers,
                mode="measure",
                candidates=[(k, c.to_dict()) for k, c in todo],
                deadline=deadline,
            )
            results, current = ray.get(self.ledger.read.remote())
            if error is not None and current is not None:
                oom = "out of memory" in error
                reason = "out of memory" if oom else f"failed: {error.splitlines()[0][:200]}"
                ray.get(self.ledger.done.remote(current, {"status": reason}))
                results[current] = {"status": reason}
            elif error is not None:
                raise RuntimeError(f"a calibration group failed: {error}")
            left = [(k, c) for k, c in todo if k not in results]
            if len(left) == len(todo) or error is None:
                break
            todo = left

    def results(self) -> dict[str, Any]:
        return ray.get(self.ledger.read.remote())[0]

    def cleanup(self) -> None:
        """Removes the groups' Ray Train folders (nothing in them is kept: no checkpoints) from
        a local storage path; a URI's are left."""
        import shutil
        from pathlib import Path

        if "://" in self.storage:
            return
        for name in self.run_names:
            shutil.rmtree(Path(self.storage) / name, ignore_errors=True)
