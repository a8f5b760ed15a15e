"""Data at scale: each rank's memory, rows read and speed as the dataset grows.

Writes synthetic token data (rows of 129 uint16 tokens, row groups of 128 rows, files of 256k
rows) at N, 2N and 4N rows, then for each size runs one epoch of reading alone on 2 ranks (two
Ray actors, each the reader a training worker runs: `worker/ingest.py::RankReader`, global batch
1024, so each rank's share of a window is 4 row groups) and prints per rank: peak RSS and its
growth over the rank before reading, rows read against N/W, rows/s and time to the first
window. `--train-steps K` also trains a small GPT for K steps on each size with `rayacc`'s fit
(2 workers) and prints rank 0's peak RSS and the time from fit() to the first step.

With `--baseline-src DIR` (a `git worktree` of an earlier commit) it reads the N dataset with
that checkout's reader as well (every rank streams the whole dataset through Ray Data and keeps
its rows: `fetch_rows`) and prints the ratio of rows/s.

    .venv/bin/python bench/data_scale.py --rows 1000000 --train-steps 20
    git worktree add /tmp/before d593a66 && \
        .venv/bin/python bench/data_scale.py --rows 1000000 --baseline-src /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
WIDTH = 129
GROUP_ROWS = 128
FILE_ROWS = 1 << 18
GLOBAL_BATCH = 1024
WORKERS = 2


def write_tokens(folder: Path, rows: int, seed: int = 0) -> None:
    """Random token rows (ids < 4096), uint16, in files of FILE_ROWS rows."""
    if (
        folder.exists()
        and sum(pq.ParquetFile(f).metadata.num_rows for f in folder.iterdir()) == rows
    ):
        return
    folder.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        f.unlink()
    rng = np.random.default_rng(seed)
    schema = pa.schema(
        [("tokens", pa.list_(pa.uint16()))], metadata={b"rayacc.vocab_size": b"4096"}
    )
    for part, lo in enumerate(range(0, rows, FILE_ROWS)):
        n = min(FILE_ROWS, rows - lo)
        values = pa.array(rng.integers(0, 4096, n * WIDTH, dtype=np.uint16))
        offsets = pa.array(np.arange(0, (n + 1) * WIDTH, WIDTH, dtype=np.int32))
        table = pa.Table.from_arrays([pa.ListArray.from_arrays(offsets, values)], schema=schema)
        pq.write_table(table, folder / f"part-{part:05d}.parquet", row_group_size=GROUP_ROWS)


def rank_epoch(kind: str, info_dict: dict, groups, rank: int) -> dict:
    """One epoch of rank `rank`'s reads (in a Ray actor: a process of its own, as a worker;
    the dataset's description and row groups come from the driver, as in a run)."""
    import psutil

    from rayacc.data.order import EpochLayout
    from rayacc.data.sources import DatasetInfo

    proc = psutil.Process()
    info = DatasetInfo.from_dict(info_dict)

    def memory() -> tuple[int, int]:
        # RSS counts the pages of Ray's shared object store the rank has touched; USS (the
        # process's own pages) is what its reading holds
        full = proc.memory_full_info()
        return full.rss, full.uss

    rss_before, uss_before = memory()
    peak, peak_uss = rss_before, uss_before
    t0 = time.perf_counter()
    first = None
    consumed = 0
    if kind == "new":
        from rayacc.data.order import DataOrder
        from rayacc.worker.ingest import RankReader

        order = DataOrder(groups.start, groups.size, 0, True, 0.0, chunked=True)
        layout = EpochLayout(order.num_train_rows, GLOBAL_BATCH, 64, WORKERS)
        reader = RankReader(info, groups, order, info.path)
        lo, hi = layout.rank_intervals(rank)
        reader.start([reader.epoch_reads(0, lo, hi)], np.zeros(0, dtype=np.int64))
        for k in range(len(lo)):
            rows = reader.window(0, k)
            consumed += len(rows)
            first = first or time.perf_counter() - t0
            if k % 16 == 0 or k == len(lo) - 1:
                rss, uss = memory()
                peak, peak_uss = max(peak, rss), max(peak_uss, uss)
        read = reader.rows_read
    else:
        # the reader before chunked reads: every rank streams the whole dataset, keeps its rows
        import ray.data

        from rayacc.data.order import epoch_order, split_train_val
        from rayacc.worker.ingest import fetch_rows

        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ctx.enable_progress_bars = False
        train, _ = split_train_val(info.num_rows, 0.0, 0)
        layout = EpochLayout(len(train), GLOBAL_BATCH, 64, WORKERS)
        ids = epoch_order(train, 0, 0, True)[layout.rank_positions(0, rank)]
        held = fetch_rows(ray.data.read_parquet(info.path), info, np.sort(ids))
        first = time.perf_counter() - t0
        local = np.searchsorted(np.sort(ids), ids)
        share = GLOBAL_BATCH // WORKERS
        for lo in range(0, len(local), share):
            held.take(local[lo : lo + share])
            consumed += len(local[lo : lo + share])
        rss, uss = memory()
        peak, peak_uss = max(peak, rss), max(peak_uss, uss)
        read = info.num_rows
    return {
        "rank": rank,
        "rows": consumed,
        "rows_read": read,
        "seconds": time.perf_counter() - t0,
        "first_window_s": first,
        "rss_before_mb": rss_before / 2**20,
        "peak_rss_mb": peak / 2**20,
        "uss_before_mb": uss_before / 2**20,
        "peak_uss_mb": peak_uss / 2**20,
    }


def read_epoch(kind: str, path: str) -> list[dict]:
    import ray

    from rayacc.data.sources import describe_dataset

    info = describe_dataset(path)
    groups = None
    if kind == "new":
        from rayacc.data.sources import row_groups

        groups = row_groups(info.path)
    info = {k: v for k, v in info.to_dict().items() if k not in ("num_row_groups", "data_bytes")}

    @ray.remote(num_cpus=0.5)
    class Rank:
        def run(self, rank: int) -> dict:
            return rank_epoch(kind, info, groups, rank)

    ranks = [Rank.remote() for _ in range(WORKERS)]
    return ray.get([r.run.remote(i) for i, r in enumerate(ranks)])


def train_steps(path: str, steps: int, work: Path) -> dict:
    from rayacc import TrainConfig, fit

    cfg = TrainConfig.from_dict(
        {
            "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 128},
            "data": {"source": path, "val_fraction": 0.0, "seq_len": 128, "order": "chunks"},
            "batch": {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": 64},
            "optim": {"name": "adamw", "lr": 1e-3},
            "train": {"max_steps": steps, "checkpoint_every_steps": None},
            "scaling": {"num_workers": WORKERS, "cpus_per_worker": 0.5},
            "tracking": {"enabled": False},
            "run": {"storage_path": str(work / "runs")},
        }
    )
    result = fit(cfg)
    timeline = result.summary["timeline"]
    rss = max(r["mem/rss_mb"] for r in result.history)
    return {
        "first_step_s": timeline["first_step"] - result.phases["fit_started"],
        "rank0_peak_rss_mb": rss,
        "rows_read": result.history[-1]["data/rows_read"],
        "rows_trained": steps * GLOBAL_BATCH // WORKERS,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="N")
    parser.add_argument("--scales", default="1,2,4")
    parser.add_argument("--data-dir", default=str(ROOT / ".bench-data"))
    parser.add_argument("--train-steps", type=int, default=0)
    parser.add_argument("--baseline-src", default=None)
    parser.add_argument(
        "--object-store-mb",
        type=int,
        default=2048,
        help="Ray's object store: a rank's RSS also counts the store's pages it has read "
        "blocks from, up to this size",
    )
    parser.add_argument("--reader", default="new", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    import ray

    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=args.object_store_mb * 2**20,
    )
    data = Path(args.data_dir)
    if args.json:  # a baseline child: one size, one reader, JSON out
        print(json.dumps(read_epoch(args.reader, str(data / f"n{args.rows}"))))
        return
    results = {}
    for scale in (int(s) for s in args.scales.split(",")):
        n = args.rows * scale
        folder = data / f"n{n}"
        t = time.perf_counter()
        write_tokens(folder, n)
        print(f"data {n:,} rows × {WIDTH} tokens at {folder} ({time.perf_counter() - t:.1f} s)")
        ranks = read_epoch("new", str(folder))
        results[scale] = ranks
        for r in ranks:
            print(
                f"  read  {scale}N rank {r['rank']}: peak USS {r['peak_uss_mb']:.0f} MB "
                f"(+{r['peak_uss_mb'] - r['uss_before_mb']:.0f}), RSS {r['peak_rss_mb']:.0f} MB, "
                f"rows read {r['rows_read']:,} = {r['rows_read'] / (n / WORKERS):.3f} × N/W, "
                f"{r['rows'] / r['seconds']:,.0f} rows/s, first window {r['first_window_s']:.2f} s"
            )
        if args.train_steps:
            tr = train_steps(str(folder), args.train_steps, data)
            print(
                f"  train {scale}N: rank 0 peak RSS {tr['rank0_peak_rss_mb']:.0f} MB, first step "
                f"{tr['first_step_s']:.1f} s after fit() started, rows read "
                f"{tr['rows_read']:,} for {tr['rows_trained']:,} trained"
            )
    scales = sorted(results)
    for key in ("peak_uss_mb", "peak_rss_mb"):
        peaks = [max(r[key] for r in results[s]) for s in scales]
        print(
            f"{key} (largest rank) across {scales[0]}N..{scales[-1]}N: "
            f"{' / '.join(f'{p:.0f}' for p in peaks)} MB, max/min {max(peaks) / min(peaks):.3f}"
        )
    reads = [r["rows_read"] / r["rows"] for s in scales for r in results[s]]
    print(f"rows read / rows consumed per rank: max {max(reads):.3f}")
    if args.baseline_src:
        env = dict(os.environ, PYTHONPATH=str(Path(args.baseline_src).resolve()))
        ray.shutdown()
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--rows",
                str(args.rows),
                "--data-dir",
                str(data),
                "--reader",
                "old",
                "--json",
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            cwd=args.baseline_src,
        ).stdout
        old = json.loads(next(line for line in out.splitlines() if line.startswith("[{")))
        for r in old:
            print(
                f"  baseline N rank {r['rank']}: peak USS {r['peak_uss_mb']:.0f} MB, "
                f"RSS {r['peak_rss_mb']:.0f} MB, "
                f"{r['rows'] / r['seconds']:,.0f} rows/s, first window {r['first_window_s']:.2f} s"
            )
        new_rate = sum(r["rows"] / r["seconds"] for r in results[scales[0]])
        old_rate = sum(r["rows"] / r["seconds"] for r in old)
        print(f"rows/s at N, this reader / baseline: {new_rate / old_rate:.2f}")


if __name__ == "__main__":
    main()
