"""What watching for a spot reclaim costs per window on the default job (jobs/digits.yaml: the
MLP, micro-batch 32 × accumulation 4 on 2 workers), inside real Ray Train workers:

- rayacc's check: each rank reads its own Ray Train context (`PreemptionWatch.signal()`) and the
  flag rides the window's counts in the gradient all-reduce (no collective of its own);
- for contrast, Ray's barrier `ray.train.get_preemption_info()` called once per window.

Windows with the check and without it are interleaved; prints medians and the ratios to the
step time (the target: the check at most 1 % of a step).

    .venv/bin/python bench/preemption_check.py [--windows 400]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def train_loop(config: dict) -> dict:
    import ray.train
    import torch

    from rayacc import TrainConfig
    from rayacc.data.sources import describe_dataset
    from rayacc.rank.build import build_rank
    from rayacc.worker.preemption import PreemptionWatch, ray_notice_sources

    torch.set_num_threads(1)
    cfg = TrainConfig.from_yaml(ROOT / "jobs" / "digits.yaml")
    info = describe_dataset("digits")
    parts = build_rank(cfg, info, torch.device("cpu"), 1e-3)
    step, loss_fn, count = parts.accumulate, parts.loss_fn, parts.count
    g = torch.Generator().manual_seed(ray.train.get_context().get_world_rank())
    micro = [
        {
            "features": torch.randn(32, info.num_features, generator=g),
            "label": torch.randint(0, info.num_classes, (32,), generator=g),
        }
        for _ in range(4)
    ]
    local, agree, end_now = ray_notice_sources()
    watch = PreemptionWatch(local, agree, end_now=end_now)
    with_check, without = [], []
    for i in range(config["windows"]):
        checked = i % 2 == 0
        t = time.perf_counter()
        result = step(micro, loss_fn, count, signal=watch.signal() if checked else False)
        if checked:
            watch.after_window(result.signals, time.perf_counter() - t)
        (with_check if checked else without).append(time.perf_counter() - t)
    # the check alone, many times over: its cost is far below a window's noise
    n = 100_000
    t = time.perf_counter()
    for _ in range(n):
        watch.signal()
    check_s = (time.perf_counter() - t) / n
    barrier = []
    for _ in range(config["barriers"]):
        t = time.perf_counter()
        ray.train.get_preemption_info()
        barrier.append(time.perf_counter() - t)
    warm = 20
    return {
        "step_s": statistics.median(without[warm:]),
        "step_checked_s": statistics.median(with_check[warm:]),
        "check_s": check_s,
        "barrier_s": statistics.median(barrier),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--windows", type=int, default=400)
    parser.add_argument("--barriers", type=int, default=40)
    args = parser.parse_args()

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    import tempfile

    with tempfile.TemporaryDirectory() as storage:
        result = TorchTrainer(
            train_loop,
            train_loop_config={"windows": args.windows, "barriers": args.barriers},
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(storage_path=storage, name="preemption-check"),
        ).fit()
    r = result.return_value
    step_ms = r["step_s"] * 1e3
    print("default job (jobs/digits.yaml), 2 Ray Train workers, one window = 4 micro-batches")
    print(f"  window without the check      {step_ms:8.3f} ms (median)")
    print(f"  window with the check         {r['step_checked_s'] * 1e3:8.3f} ms (median)")
    print(f"  the check (local read + flag) {r['check_s'] * 1e6:8.3f} µs per window")
    print(f"  ray.train.get_preemption_info {r['barrier_s'] * 1e3:8.3f} ms per call (a barrier)")
    print(f"ratio check / step:   {r['check_s'] / r['step_s']:.5%}  (target ≤ 1 %)")
    print(f"ratio barrier / step: {r['barrier_s'] / r['step_s']:.1%}  (were it called per window)")
    ray.shutdown()


if __name__ == "__main__":
    main()
