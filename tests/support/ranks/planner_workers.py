"""Rank bodies for the planner's 2-process gloo test of its probe (no Ray): the calibration's
`measure_candidate` on a model that runs out of memory on rank 1 only."""

from __future__ import annotations

import datetime
import traceback

import torch
import torch.distributed as dist


def run_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from rayacc.config import TrainConfig
    from rayacc.driver.calibrate import measure_candidate
    from rayacc.engine import TrialOutOfMemory
    from rayacc.planner.candidates import Candidate

    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=15),
    )
    torch.set_num_threads(1)
    given = torch.load(f"{out_dir}/input.pt", weights_only=False)
    cfg = TrainConfig.model_validate(given["cfg"])
    info, rows = given["info"], given["rows"]
    out: dict = {}

    def measure(c, budget=0.0):
        return measure_candidate(
            cfg, info, rows, c, rank=rank, device=torch.device("cpu"), budget=budget
        )

    try:
        # DDP: rank 1 alone runs out of memory at 8: both ranks hear it, neither waits
        out["ddp_oom"] = measure(Candidate(2, 8, 2))
        out["ddp_fits"] = measure(Candidate(2, 4, 4))
        # budgets that differ per rank: one verdict, the strictest
        used = out["ddp_fits"]["memory_bytes"]
        out["budgets"] = measure(Candidate(2, 4, 4), budget=2 * used if rank == 0 else used / 2)
        # a tensor-parallel candidate: one group of both ranks, reading the same rows
        tp = TrainConfig.model_validate(given["tp_cfg"])
        out["tensor_parallel"] = measure_candidate(
            tp, given["tp_info"], given["tp_rows"],
            Candidate(2, 4, 2, "fsdp", "every_micro_step", tensor_parallel=2),
            rank=rank, device=torch.device("cpu"), budget=0.0,
        )  # fmt: skip
        # a pipeline candidate: 2 stages, one rank each, the probe one window of its schedule
        out["pipeline"] = measure_candidate(
            tp, given["tp_info"], given["tp_rows"],
            Candidate(2, 2, 4, "fsdp", "window_end", pipeline_parallel=2),
            rank=rank, device=torch.device("cpu"), budget=0.0,
        )  # fmt: skip
        dist.barrier()
        # FSDP: the probe's forward is a collective; the rank that ran out raises (the group
        # fails and restarts past the candidate) instead of answering alone
        try:
            out["fsdp"] = measure(Candidate(2, 8, 2, "fsdp", "every_micro_step"))
        except TrialOutOfMemory as exc:
            out["fsdp_raised"] = f"TrialOutOfMemory({exc.micro_batch_size})"
        except Exception as exc:  # the peer left: a collective timed out
            out["fsdp_raised"] = type(exc).__name__
    except Exception:
        out["error"] = traceback.format_exc()
    finally:
        torch.save(out, f"{out_dir}/rank{rank}.pt")
