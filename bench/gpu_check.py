"""The first GPU run, checked: `rayacc train` of jobs/gpu_gpt.yaml on one GPU worker, then
bench/gpu_step.py against the bare anchor; one table of what passed and the figures.

Run through bench/gpu_check.sh (it sets up the wheels); `--dry-run` runs every step on CPU with
a tiny model, gloo and fp32 where a GPU run would use NCCL and bf16, so that CI proves the
script and the code paths it drives.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "jobs" / "gpu_gpt.yaml"
TRAIN_TIMEOUT_S = 300
STEP_TIMEOUT_S = 300

# what the dry run changes in the job: a tiny model and data, CPU, gloo; the rest as on a GPU
DRY_OVERRIDES = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "data.seq_len=32",
    "batch.global_batch_size=32",
    "batch.memory_budget_mb=4096",
    "scaling.use_gpu=false",
    "scaling.cpus_per_worker=1",
]


def token_data(path: Path, seq_len: int, rows: int, vocab: int) -> str:
    """Random token sequences of seq_len + 1 tokens (inputs and next-token targets)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (rows, seq_len + 1), dtype=np.int64)
    tokens[0, 0] = vocab - 1  # the vocabulary is exactly `vocab`
    pq.write_table(pa.table({"tokens": pa.array(list(tokens), pa.list_(pa.int64()))}), path)
    return str(path)


def run(cmd: list[str], log: Path, timeout: float) -> tuple[int, str, float]:
    """(exit status, output, seconds); 124 when it ran past `timeout`."""
    t0 = time.time()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=dict(os.environ)
        )
        code, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        code, out = 124, f"{exc.stdout or ''}{exc.stderr or ''}"
        out = out if isinstance(out, str) else out.decode(errors="replace")
    log.write_text(out)
    return code, out, time.time() - t0


# the same job sharded: FSDP2 (bf16 compute, fp32 reduction), activation checkpointing, the
# auto search in lockstep (a trial out of memory restarts the group below it); not compiled,
# to keep the check within its minutes (the DDP run above is)
FSDP_OVERRIDES = [
    "train.strategy=fsdp",
    "train.compile=false",
    "train.activation_checkpointing=full",
    # the shards in pinned host memory (offload's device path) and HSDP's mesh from the
    # placement (one GPU: 1 × 1; HSDP proper needs two nodes' devices)
    "fsdp.offload=cpu",
    "fsdp.replicate=auto",
    "run.max_failures=3",
]


def train(out_dir: Path, dry: bool, name: str, extra: list[str]) -> tuple[int, str, float, Path]:
    """`rayacc train` of the job: (exit code, output, seconds, timings file)."""
    seq_len, global_batch = (32, 32) if dry else (1024, 512)
    rows_needed = int(global_batch * 6 / 0.95) + 64
    data = out_dir / "tokens.parquet"
    if not data.is_file():
        token_data(data, seq_len, rows_needed, 256 if dry else 50304)
    timings = out_dir / f"timings_{name}.json"
    entry = "import sys, rayacc.cli as c; c.run()"
    cmd = [sys.executable, "-c", entry, "train", "-c", str(JOB), f"data.source={data}"]
    cmd += [f"run.storage_path={out_dir / 'runs'}", *(DRY_OVERRIDES if dry else []), *extra]
    cmd += ["--timings", str(timings)]
    code, out, wall = run(cmd, out_dir / f"{name}.log", TRAIN_TIMEOUT_S)
    return code, out, wall, timings


def check_fsdp_train(out_dir: Path, dry: bool) -> list[tuple[str, bool, str]]:
    """The job under FSDP on one worker (the sharded code paths, its shards offloaded to host
    memory; sharding itself needs two devices): it trains, its final checkpoint is sharded, and
    the group says the mesh it laid from its placement."""
    code, out, wall, timings = train(out_dir, dry, "train_fsdp", FSDP_OVERRIDES)
    checks = [("fsdp: rayacc train exits 0", code == 0, f"exit {code}, {wall:.0f} s")]
    if code != 0:
        last = out.strip().splitlines()[-1][:120] if out.strip() else ""
        return [*checks, ("(see train_fsdp.log)", False, last)]
    ckpt = json.loads(timings.read_text())["run"].get("checkpoint_dir")
    sharded = bool(ckpt) and (Path(ckpt) / "shards" / ".metadata").is_file()
    checks.append(("fsdp: final checkpoint sharded", sharded, str(ckpt)))
    search = re.search(r"micro-batch (\d+) × accumulation (\d+) from step 1 \([^)]*\)", out)
    perf = re.search(r"per step \(median[^:]*\): (.*)", out)
    figures = (search.group(0) + "; " if search else "") + (perf.group(1) if perf else "")
    checks.append(("fsdp: bf16 + activation checkpointing + offload steps", bool(perf), figures))
    mesh = re.search(r"FSDP mesh [^\n]*", out)
    checks.append(("fsdp: mesh from the placement", bool(mesh), mesh.group(0) if mesh else ""))
    return checks


def check_tp_train(out_dir: Path, dry: bool) -> list[tuple[str, bool | None, str]]:
    """The job over 2 GPUs as one tensor-parallel group (`train.tensor_parallel: 2` under
    FSDP, NCCL): it trains and says its mesh. Needs 2 GPUs: on fewer (and on the CPU dry run,
    whose suite runs tensor parallelism on gloo ranks) the row says so."""
    import torch

    gpus = 0 if dry else torch.cuda.device_count()
    if gpus < 2:
        return [("tp: FSDP × tensor parallel 1 × 2", None, f"needs 2 GPUs ({gpus} here)")]
    extra = ["train.strategy=fsdp", "train.tensor_parallel=2", "train.compile=false"]
    extra += ["scaling.num_workers=2", "run.name=tp"]
    code, out, wall, _ = train(out_dir, dry, "train_tp", extra)
    mesh = re.search(r"FSDP × TP mesh [^\n]*", out)
    return [
        ("tp: rayacc train exits 0", code == 0, f"exit {code}, {wall:.0f} s"),
        ("tp: the mesh it laid", bool(mesh), mesh.group(0) if mesh else ""),
    ]


def check_train(out_dir: Path, dry: bool) -> list[tuple[str, bool, str]]:
    """Runs `rayacc train` and returns (check, passed, figures) rows."""
    code, out, wall, timings = train(out_dir, dry, "train", [])
    checks = [("rayacc train exits 0", code == 0, f"exit {code}, {wall:.0f} s")]
    if code != 0:
        last = out.strip().splitlines()[-1][:120] if out.strip() else ""
        return [*checks, ("(see train.log)", False, last)]
    info = json.loads(timings.read_text())["run"]
    want_backend, want_device = ("gloo", "cpu") if dry else ("nccl", "cuda")
    checks.append(
        (
            f"one worker on {want_device} ({want_backend} or no group)",
            str(info["device"]).startswith(want_device) and info["backend"] in (want_backend, None),
            f"device {info['device']}, backend {info['backend']}",
        )
    )
    search = re.search(
        r"micro-batch (\d+) × accumulation (\d+) from step 1 \(auto search[^)]*\)", out
    )
    oom = re.search(r"out of memory at ([\d, ]+)", search.group(0)) if search else None
    checks.append(
        (
            "auto micro-batch" + ("" if dry else " with a real CUDA out-of-memory"),
            bool(search) and (dry or bool(oom)),
            search.group(0) if search else "no search line",
        )
    )
    val = re.findall(r"val_loss ([\d.]+)", out)
    checks.append(("validation ran", bool(val), f"val_loss {val[-1]}" if val else "none"))
    ckpt = info.get("checkpoint_dir")
    complete = bool(ckpt) and (Path(ckpt) / "meta.json").is_file()
    checks.append(("final checkpoint complete", complete, str(ckpt)))
    perf = re.search(r"per step \(median[^:]*\): (.*)", out)
    checks.append(("bf16 + compile + fused AdamW steps", code == 0, perf.group(1) if perf else ""))
    return checks


def check_gpu_step(out_dir: Path, dry: bool) -> list[tuple[str, bool, str]]:
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_step.py"), "--out", str(out_dir)]
    cmd += (
        # one configuration, with accumulation (its path is the one the GPU rows take)
        ["--tiny", "--no-compile", "--steps", "2", "--warmup", "1", "--micros", "2"]
        if dry
        else ["--micros", "16"]
    )
    code, _, wall = run(cmd, out_dir / "gpu_step.log", STEP_TIMEOUT_S)
    rows = []
    result = out_dir / "gpu_step.json"
    if code == 0 and result.is_file():
        for r in json.loads(result.read_text())["rows"]:
            rows.append(
                (
                    f"gpu_step {r['micro']}×{r['accum']} compile={r['compiled']}",
                    True,
                    f"bare {r['bare']['tokens_per_s']:,} tok/s, rayacc "
                    f"{r['rayacc']['tokens_per_s']:,} tok/s, ratio {r['ratio']:.3f}",
                )
            )
    return [("bench/gpu_step.py exits 0", code == 0, f"exit {code}, {wall:.0f} s"), *rows]


def check_planner(out_dir: Path, dry: bool) -> list[tuple[str, bool, str]]:
    """bench/planner.py: the planner's pick against an exhaustive sweep of a small grid (on
    the GPU both jobs on one GPU worker; the dry run a grid of two on digits)."""
    cmd = [sys.executable, str(ROOT / "bench" / "planner.py")]
    cmd += ["--jobs", "digits", "--tiny"] if dry else ["--device", "cuda", "--budget-s", "90"]
    code, out, wall = run(cmd, out_dir / "planner.log", STEP_TIMEOUT_S)
    ratio = re.search(r"^pick / best measured: ([\d.]+)$", out, re.M)
    summary = [line.strip() for line in out.splitlines() if "pick/best" in line]
    return [
        ("bench/planner.py ran", code in (0, 1) and bool(ratio), f"exit {code}, {wall:.0f} s"),
        ("planner: pick / best measured", bool(ratio), "; ".join(summary) or "no summary"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="on CPU, a tiny model")
    parser.add_argument("--out", default=os.environ.get("OUT") or "/tmp/rayacc_gpu_check")
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = check_train(out_dir, args.dry_run) + check_gpu_step(out_dir, args.dry_run)
    rows += check_fsdp_train(out_dir, args.dry_run)
    rows += check_tp_train(out_dir, args.dry_run)
    rows += check_planner(out_dir, args.dry_run)
    width = max(len(name) for name, _, _ in rows)
    print(f"\n{'check':{width}}  result  figures")
    for name, ok, figures in rows:
        result = "SKIP" if ok is None else "PASS" if ok else "FAIL"
        print(f"{name:{width}}  {result:6}  {figures}")
    passed = all(ok is not False for _, ok, _ in rows)
    where = "dry run on CPU" if args.dry_run else "GPU"
    print(f"\n{'all passed' if passed else 'FAILED'} ({where}); logs in {out_dir}")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
