"""GPT-2 small on one GPU: rayacc (Ray Train, one GPU worker, the engine's accumulation step)
against the bare-PyTorch anchor (`bare_gpt2_anchor.py`), same model (124 M parameters, block
1024, vocab 50304), global batch 64 sequences, bf16, in one command. For micro 16 × accum 4 and
8 × 8, eager and compiled, prints tokens/s, TFLOP/s, MFU against the measured bf16 ceiling of
the H200 (790 TFLOP/s), peak memory, and the ratio rayacc / bare.

On the GPU machine, with Ray carried as a wheelhouse (see bench/results/gpu.md):
    python3 bench/gpu_step.py [--steps 8] [--out DIR]
A smoke run of the same code path on CPU with a tiny model:
    .venv/bin/python bench/gpu_step.py --tiny
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
# Ray's worker processes find the project through the environment, not this process's sys.path
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
)

import bare_gpt2_anchor as anchor  # noqa: E402

from rayacc import TrainConfig  # noqa: E402

BF16_CEILING_TFLOPS = 790.0
"""Measured dense bf16 matmul rate of the H200 used for these checks (../shared/gpu)."""

GPT2 = {"vocab": 50304, "block": 1024, "layers": 12, "heads": 12, "d": 768}
TINY = {"vocab": 512, "block": 64, "layers": 2, "heads": 2, "d": 64}


def token_parquet(path: Path, cfg: dict, rows: int) -> str:
    """Random token sequences of block + 1 tokens (as the anchor trains on); the largest id
    occurs once so the dataset's vocabulary is exactly `vocab`."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, cfg["vocab"], (rows, cfg["block"] + 1), dtype=np.int64)
    tokens[0, 0] = cfg["vocab"] - 1
    pq.write_table(pa.table({"tokens": pa.array(list(tokens), pa.list_(pa.int64()))}), path)
    return str(path)


def rayacc_config(args, cfg: dict, data: str, micro: int, compiled: bool, storage: str):
    gpu = torch.cuda.is_available()
    return TrainConfig.from_dict(
        {
            "seed": 0,
            "model": {
                "name": "gpt",
                "n_layer": cfg["layers"],
                "n_head": cfg["heads"],
                "n_embd": cfg["d"],
                "block_size": cfg["block"],
            },
            "data": {
                "source": data,
                "shuffle": False,
                "val_fraction": 0.0,
                "seq_len": cfg["block"],
            },
            "batch": {"global_batch_size": args.global_batch, "micro_batch_size": micro},
            # the anchor's optimizer: AdamW 6e-4, clipping at 1.0, fused on GPU
            "optim": {"name": "adamw", "lr": 6e-4, "schedule": "constant", "max_grad_norm": 1.0},
            "train": {
                "max_steps": args.warmup + args.steps,
                "precision": "bf16" if gpu else "fp32",
                "compile": compiled,
            },
            "scaling": {"num_workers": 1, "use_gpu": gpu, "cpus_per_worker": 1},
            "tracking": {"enabled": False},
            "run": {"storage_path": storage},
        }
    )


def run_rayacc(args, cfg, data, micro, compiled, storage) -> dict:
    from rayacc.driver.fit import fit

    result = fit(rayacc_config(args, cfg, data, micro, compiled, storage))
    steady = [r for r in result.history if r["step"] > args.warmup]
    tokens = statistics.median(r["perf/tokens_per_s"] for r in steady)
    tflops = statistics.median(r["perf/tflops"] for r in steady)
    return {
        "tokens_per_s": round(tokens),
        "tflops": round(tflops, 1),
        "peak_gib": round(max(r["mem/peak_mb"] for r in steady) / 1024, 2),
        "data_wait": statistics.median(r["perf/data_wait_frac"] for r in steady),
        "loss": round(steady[-1]["train/loss"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="tiny model, CPU allowed (smoke)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--no-compile", action="store_true", help="eager rows only")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument(
        "--micros", default=None, help="micro-batches to try, e.g. 16,8 (default: 16,8; tiny 4,2)"
    )
    args = parser.parse_args()
    cfg = TINY if args.tiny else GPT2
    args.global_batch = 8 if args.tiny else 64
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not args.tiny:
        sys.exit("no GPU here: run with --tiny for a CPU smoke run of the same code path")
    micros = (4, 2) if args.tiny else (16, 8)
    if args.micros:
        micros = tuple(int(m) for m in args.micros.split(","))
    modes = (False,) if args.no_compile else (False, True)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"torch {torch.__version__} on {name}; model {cfg}; global batch {args.global_batch}")

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = token_parquet(
            Path(tmp) / "tokens.parquet", cfg, args.global_batch * (args.warmup + args.steps)
        )
        for compiled in modes:
            for micro in micros:
                accum = args.global_batch // micro
                t0 = time.perf_counter()
                bare = anchor.run(
                    cfg,
                    micro,
                    accum,
                    torch.bfloat16 if dev == "cuda" else torch.float32,
                    compiled=compiled,
                    steps=args.steps,
                    warmup=args.warmup,
                    dev=dev,
                )
                ours = run_rayacc(args, cfg, data, micro, compiled, str(Path(tmp) / "runs"))
                row = {
                    "micro": micro,
                    "accum": accum,
                    "compiled": compiled,
                    "bare": bare,
                    "rayacc": ours,
                    "ratio": ours["tokens_per_s"] / bare["tokens_per_s"],
                    "wall_s": round(time.perf_counter() - t0, 1),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_step.json"), "w") as f:
        json.dump({"device": name, "cfg": cfg, "rows": rows}, f, indent=1)
    print(
        f"\n{'micro×accum':>11} {'compile':>7} {'bare tok/s':>11} {'rayacc tok/s':>12} "
        f"{'ratio':>6} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB b/r':>13}"
    )
    for r in rows:
        b, o = r["bare"], r["rayacc"]
        mfu = o["tflops"] / BF16_CEILING_TFLOPS
        print(
            f"{r['micro']:>5}×{r['accum']:<5} {r['compiled']!s:>7} {b['tokens_per_s']:>11,} "
            f"{o['tokens_per_s']:>12,} {r['ratio']:>6.3f} {o['tflops']:>8} {mfu:>6.1%} "
            f"{b['peak_gib']:>6}/{o['peak_gib']:<6}"
        )
    print(f"(MFU of rayacc against the measured bf16 ceiling, {BF16_CEILING_TFLOPS:.0f} TFLOP/s)")


if __name__ == "__main__":
    main()
