"""Pipeline parallelism on CPU: each schedule's measured idle share of a window against the
schedule's own, (P − 1) / (v·m + P − 1), as the accumulation m grows; 2 gloo ranks (one stage
each, two under the looped schedules), a GPT of 8 blocks × 256 wide over 128 tokens, micro-batch
4 per stage, windows through rayacc's accumulation step (FSDP with `pipeline_parallel`).

For each (schedule, m), 2 fresh processes run 4 windows and print the median of the last 3:
the window's time, rank 0's measured idle share (`perf/pipeline_idle_frac`: the schedule step's
time the rank computed nothing), the schedule's share (`perf/pipeline_bubble`), their ratio,
and the sends rank 0 made (`comm/p2p_sends`).

    .venv/bin/python bench/pipeline_bubble.py
    .venv/bin/python bench/pipeline_bubble.py --schedules 1f1b --micro-steps 2,8   # a quick look

Results: bench/results/pipeline_bubble.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _rank(rank: int, world: int, init: str, out: str, schedule: str, m: int, args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    from rayacc.config import TrainConfig
    from rayacc.data.sources import DatasetInfo
    from rayacc.engine import collate_tokens
    from rayacc.engine.parallel import FSDP
    from rayacc.engine.step import AccumulationStep
    from rayacc.models.registry import loss_functions
    from rayacc.optim import build_optimizer
    from rayacc.rank.build import model_recipe

    seq, vocab = 128, 64
    cfg = TrainConfig.model_validate(
        {
            "model": {
                "name": "gpt",
                "n_layer": args.layers,
                "n_head": 4,
                "n_embd": args.width,
                "block_size": seq,
            },
            "data": {"seq_len": seq},
            "batch": {"global_batch_size": 4 * m, "micro_batch_size": 4},
            "optim": {"name": "adamw", "lr": 1e-3},
        }
    )
    info = DatasetInfo(path="x.parquet", format="tokens", num_rows=64, vocab_size=vocab,
                       max_tokens=seq + 1)  # fmt: skip
    strategy = FSDP("window_end", pipeline_parallel=world, pipeline_schedule=schedule)
    model = strategy.build(model_recipe(cfg, info), torch.device("cpu"))
    optimizer = build_optimizer(cfg.optim, model.parameters(), 1e-3, torch.device("cpu"), strategy)
    loss_fn, count = loss_functions(info, None, strategy)
    step = AccumulationStep(model, optimizer, strategy=strategy)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, vocab, (seq + 1,), generator=g) for _ in range(4 * m)]
    batches = [collate_tokens(rows[i : i + 4]) for i in range(0, 4 * m, 4)]
    seen = []
    for _ in range(4):
        r = step(batches, loss_fn, count)
        seen.append((r.step_time_s, r.pipeline.idle_s, r.pipeline.bubble, r.pipeline.p2p_sends))
    if rank == 0:
        torch.save(seen, Path(out) / "rank0.pt")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b,zbv")
    parser.add_argument("--micro-steps", default="2,4,8,16")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    print(f"2 ranks, GPT {args.layers} × {args.width}, micro-batch 4 × 128 tokens, torch "
          f"{torch.__version__}")  # fmt: skip
    print(f"{'schedule':18} {'m':>3} {'window s':>9} {'idle':>7} {'schedule':>9} {'ratio':>6} "
          f"{'sends':>6}")  # fmt: skip
    for schedule in args.schedules.split(","):
        for m in map(int, args.micro_steps.split(",")):
            with tempfile.TemporaryDirectory() as folder:
                init = str(Path(folder) / "init")
                mp.start_processes(_rank, args=(2, init, folder, schedule, m, args), nprocs=2,
                                   join=True, start_method="spawn")  # fmt: skip
                seen = torch.load(Path(folder) / "rank0.pt")[1:]
            window = statistics.median(s[0] for s in seen)
            idle = statistics.median(s[1] / s[0] for s in seen)
            bubble, sends = seen[-1][2], seen[-1][3]
            print(f"{schedule:18} {m:3d} {window:9.3f} {idle:7.1%} {bubble:9.1%} "
                  f"{idle / bubble:6.2f} {sends:6d}")  # fmt: skip


if __name__ == "__main__":
    main()
