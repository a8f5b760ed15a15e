"""Per-step cost accounting: FLOPs, model FLOPs utilisation, and where a step's time went."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["PEAK_TFLOPS", "StepClock", "StepCost", "device_peak_tflops", "flops_per_item"]

PEAK_TFLOPS: list[tuple[str, str | None, tuple[float, float, float]]] = [
    ("H200", None, (989.0, 67.0, 494.0)),
    ("H100", "PCIe", (756.0, 51.0, 378.0)),
    ("H100", None, (989.0, 67.0, 494.0)),
    ("A100", None, (312.0, 19.5, 156.0)),
    ("L4", None, (121.0, 30.3, 60.0)),
    ("A10G", None, (70.0, 35.0, 35.0)),
]
"""Dense peaks of one device, TFLOP/s — (bf16/fp16 tensor cores, fp32 without them, TF32
tensor cores) — from the vendor's data sheets (no 2:4 sparsity; H100/H200: the SXM parts),
by the model named in the device name (with the variant, where it changes the peak; the first
match wins). The A10G, AWS's variant of the A10, trades tensor for CUDA-core rate."""


def device_peak_tflops(
    device: torch.device,
    configured: float | None = None,
    precision: str = "bf16",
    allow_tf32: bool = False,
) -> float | None:
    """`configured`, else a known GPU's dense peak at the step's precision (fp32: TF32 tensor
    cores when allowed); None on a CPU or a device the table does not know."""
    if configured is not None:
        return configured
    if device.type != "cuda":
        return None
    return known_peak(torch.cuda.get_device_name(device), precision, allow_tf32)


def known_peak(name: str, precision: str, allow_tf32: bool = False) -> float | None:
    """The table's peak for a device name (`torch.cuda.get_device_name`), or None."""
    words = set(re.split(r"[\s_-]+", name))
    for model, variant, (half, fp32, tf32) in PEAK_TFLOPS:
        if model in words and (variant is None or variant in words):
            if precision in ("bf16", "fp16"):
                return half
            return tf32 if allow_tf32 else fp32
    return None


def flops_per_item(model: nn.Module, item_shape: tuple[int, ...] | None = None) -> float | None:
    """Training FLOPs per loss item from the model's own `flops_per_item(item_shape)`, when it
    has one (the built-in models do; a user factory may add it)."""
    fn = getattr(model, "flops_per_item", None)
    return float(fn(item_shape)) if callable(fn) else None


def recompute_flops_per_item(model: nn.Module, item_shape: tuple[int, ...] | None = None) -> float:
    """FLOPs per loss item that activation checkpointing adds (the recomputed forwards), from
    the model's own `recompute_flops_per_item` (the GPT has one); 0 without it."""
    fn = getattr(model, "recompute_flops_per_item", None)
    return float(fn(item_shape)) if callable(fn) else 0.0


@dataclass(frozen=True)
class StepCost:
    """One optimizer step as a worker saw it: its wall time, the part spent waiting for data,
    and the loss items it trained on (for throughput and FLOPs)."""

    wall_s: float
    data_s: float
    items: int
    world_size: int
    flops_per_item: float | None = None
    peak_tflops: float | None = None
    recompute_flops_per_item: float = 0.0
    """Hardware FLOPs beyond the model's (activation checkpointing's recomputed forwards):
    counted in `perf/hardware_tflops` and `perf/hfu`, never in MFU."""

    def metrics(self, token_items: bool) -> dict[str, float]:
        out = {
            "perf/data_wait_frac": self.data_s / self.wall_s if self.wall_s > 0 else 0.0,
            "perf/step_time_s": self.wall_s,
        }
        if token_items and self.wall_s > 0:
            out["perf/tokens_per_s"] = self.items / self.wall_s
        if self.flops_per_item is not None and self.wall_s > 0:
            # per device: the window's FLOPs are spread over the ranks
            tflops = self.flops_per_item * self.items / self.wall_s / self.world_size / 1e12
            out["perf/tflops"] = tflops
            if self.peak_tflops:
                out["perf/mfu"] = tflops / self.peak_tflops
            if self.recompute_flops_per_item:
                hardware = tflops * (1 + self.recompute_flops_per_item / self.flops_per_item)
                out["perf/hardware_tflops"] = hardware
                if self.peak_tflops:
                    out["perf/hfu"] = hardware / self.peak_tflops
        return out


class StepClock:
    """Wall time of training steps, with what is not step time (validation, checkpoints, the
    gap between epochs) paused out. `lap()` closes a step and returns its wall time."""

    def __init__(self) -> None:
        self._mark = time.perf_counter()
        self.total_s = 0.0
        """Wall time of all laps."""

    def restart(self) -> None:
        """The next lap starts now (what happened since the last lap is not counted)."""
        self._mark = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        wall, self._mark = now - self._mark, now
        self.total_s += wall
        return wall

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The time spent inside is left out of the current lap."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self._mark += time.perf_counter() - t
