"""How long a checkpoint stops training, synchronous against asynchronous
(`train.checkpoint_mode`), through the whole stack on a local Ray: a GPT of 12 layers × 640
wide (64.5M parameters, vocabulary 8192, sequences of 256) on 2 CPU workers, DDP and FSDP,
AdamW (a checkpoint holds about 0.8 GB: weights and two moments), a periodic checkpoint every
`--every` steps.

For each strategy and mode it prints the median step time, the seconds the ranks waited at
each periodic checkpoint (rayacc's `Checkpointed` events: the blocking part only), that wait
over one step's time, the median time of the steps a background write overlapped (on 2 cores
the write takes CPU from them), and the checkpoint share of the training wall time (waits plus
what the overlapped steps lost, over the steps' time plus the waits). It ends with one line,
`checkpoint blocking / step: X`: the asynchronous mode's worst wait over its step time
(target ≤ 1.0).

    .venv/bin/python bench/checkpoint_blocking.py                        # about 15 minutes
    .venv/bin/python bench/checkpoint_blocking.py --layers 2 --width 64  # that it runs
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_check import token_data  # noqa: E402  (random token rows, as the GPU check's)


def run(args, strategy: str, mode: str, source: str, storage: str) -> dict:
    from rayacc import TrainConfig
    from rayacc.driver.fit import fit
    from rayacc.observe.events import Checkpointed, RunObserver

    waits: dict[int, float] = {}

    class Waits(RunObserver):
        def on_event(self, event):
            if isinstance(event, Checkpointed) and event.reason == "periodic":
                waits[event.step] = event.seconds

    cfg = TrainConfig.from_dict(
        {
            "seed": 0,
            "model": {
                "name": "gpt",
                "n_layer": args.layers,
                "n_head": args.heads,
                "n_embd": args.width,
                "block_size": args.seq,
            },
            "data": {"source": source, "shuffle": False, "seq_len": args.seq, "val_fraction": 0},
            "batch": {"global_batch_size": 16, "micro_batch_size": 4},
            "optim": {"name": "adamw", "lr": 1e-4},
            "train": {
                "strategy": strategy,
                "max_steps": args.steps,
                "checkpoint_every_steps": args.every,
                "checkpoint_mode": mode,
                "loss_chunk_tokens": None,
            },
            "scaling": {"num_workers": 2, "cpus_per_worker": 1},
            "tracking": {"enabled": False},
            "run": {"storage_path": storage, "name": f"{strategy}-{mode}"},
        }
    )
    result = fit(cfg, observers=[Waits()])
    steps = {r["step"]: r["perf/step_time_s"] for r in result.history}
    # the steps a background write may overlap: the `--every - 1` after each checkpoint
    overlapped = [steps[s + k] for s in waits for k in range(1, args.every) if s + k in steps]
    # the first steps pay the warm-up (allocations, the first gather)
    clear = [t for s, t in steps.items() if s > 2 and t not in overlapped]
    step_s = statistics.median(clear) if clear else statistics.median(steps.values())
    lost = sum(max(0.0, t - step_s) for t in overlapped) if mode == "async" else 0.0
    wall = sum(steps.values()) + sum(waits.values())
    return {
        "step_s": step_s,
        "waits": list(waits.values()),
        "overlapped_s": statistics.median(overlapped) if overlapped else float("nan"),
        "share": (sum(waits.values()) + lost) / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=640)
    parser.add_argument("--heads", type=int, default=10)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"])
    args = parser.parse_args()

    import ray

    ray.init(
        num_cpus=2, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False
    )
    folder = Path(tempfile.mkdtemp(prefix="rayacc-bench-checkpoint-"))
    source = token_data(folder / "tokens.parquet", args.seq, 16 * args.steps + 16, args.vocab)
    print(
        f"GPT {args.layers} layers × {args.width} wide, vocabulary {args.vocab}, sequences of "
        f"{args.seq}; 2 CPU workers, global batch 16 (micro 4 × accumulation 2), AdamW; "
        f"{args.steps} steps, a checkpoint every {args.every}"
    )
    print(
        f"{'strategy':<8} {'mode':<6} {'step s':>7} {'wait s (each)':>22} {'wait/step':>9} "
        f"{'overlapped step s':>17} {'share':>6}"
    )
    worst = 0.0
    for strategy in args.strategies:
        for mode in ("sync", "async"):
            r = run(args, strategy, mode, source, str(folder / "runs"))
            ratio = max(r["waits"]) / r["step_s"]
            if mode == "async":
                worst = max(worst, ratio)
            each = ", ".join(f"{w:.2f}" for w in r["waits"])
            print(
                f"{strategy:<8} {mode:<6} {r['step_s']:>7.2f} {each:>22} {ratio:>9.2f} "
                f"{r['overlapped_s']:>17.2f} {100 * r['share']:>5.1f}%",
                flush=True,
            )
    ray.shutdown()
    print(f"checkpoint blocking / step: {worst:.2f} (target ≤ 1.0)")


if __name__ == "__main__":
    main()
