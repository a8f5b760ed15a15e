"""What a rank measures of its windows: the step's record (worker/metrics.py), its own figures
for the driver's straggler judge (observe/ranks.py), its node's system figures, and every
rank's node, gathered once per group. Nothing of it costs the step beyond a read of the
process's memory and the work of building a dict."""

from __future__ import annotations

import time
from typing import Any

import ray
import torch

from rayacc.engine import StepResult, all_gather_objects, flops_per_item, recompute_flops_per_item
from rayacc.engine.noise import NoiseScale
from rayacc.engine.parallel import Strategy
from rayacc.observe.ranks import FIGURES_KEY, TIME_KEY, rank_figures
from rayacc.worker.metrics import step_record
from rayacc.worker.system import NodeSampler, ResidentMemory

__all__ = ["Telemetry"]


def _owners(coordinates) -> tuple[int, ...]:
    """Each rank's data-parallel rank from its mesh place: the order of its coordinates other
    than `tp` and `pp` (the data-parallel mesh's own order)."""
    keys = [tuple(i for d, i in place if d not in ("tp", "pp")) for place in coordinates]
    order = {key: n for n, key in enumerate(sorted(set(keys)))}
    return tuple(order[key] for key in keys)


class Telemetry:
    """One rank's measurements. `setup`: the rank's parts (the device's peak for MFU, the
    gradient noise scale it keeps); `token_items`: the loss items are tokens (the record says
    tokens/s)."""

    def __init__(self, rank: int, setup, *, token_items: bool):
        self.rank, self.peak_tflops, self.token_items = rank, setup.peak_tflops, token_items
        self.noise: NoiseScale = setup.noise
        self._settle = setup.parts.accumulate.settle_noise
        self.resident = ResidentMemory()
        self.flops_per_item: float | None = None
        self.recompute_flops = 0.0
        self.figures: list[float] = []
        """This rank's figures of its last window, sent with the next (this one's reduction
        has left)."""
        self.group_figures: tuple[float, ...] = ()
        """Every rank's figures of the window before, as the last reduction brought them:
        handed to the driver with the step's record, which judges them there."""
        self.nodes: tuple[str, ...] = ()
        """Every rank's node (`ip/node id`), in rank order."""
        self.node_ids: tuple[str, ...] = ()
        """Every rank's Ray node id, in rank order (the run's `rayacc.worker_nodes`)."""
        self.node_sampler: NodeSampler | None = None
        coordinates = setup.parts.strategy.mesh_coordinates()
        self.places = tuple(" · ".join(f"{d} {i}" for d, i in c) for c in coordinates)
        """Every rank's place on the mesh (`dp 1 · tp 0`), where ranks are more than their
        data-parallel rank; () elsewhere."""
        self.owners = _owners(coordinates)
        """Each rank's data-parallel rank, where they differ (the ranks of a share)."""

    def gather_nodes(self, system_metrics: bool) -> None:
        """Every rank's node, once per group (a straggler is named with its node); with
        `system_metrics`, the node's figures are sampled by its first rank."""
        node_id = ray.get_runtime_context().get_node_id()
        here = (ray.util.get_node_ip_address(), node_id)
        every = all_gather_objects(here)
        self.node_ids = tuple(n for _, n in every)
        self.nodes = tuple(f"{ip}/{n[:8]}" for ip, n in every)
        if system_metrics:
            self.node_sampler = NodeSampler(samples=every.index(here) == self.rank)

    def count_flops(self, strategy: Strategy, micro_batches: list[dict[str, torch.Tensor]]):
        """The model's FLOPs per loss item, counted once, on the first window's shapes."""
        if self.flops_per_item is not None or not micro_batches:
            return
        shape = tuple(next(iter(micro_batches[0].values())).shape[1:])
        model = strategy.unwrapped()
        self.flops_per_item = flops_per_item(model, shape) or 0.0
        self.recompute_flops = recompute_flops_per_item(model, shape)

    def record(self, result: StepResult, *, data_s: float, **window: Any) -> dict[str, Any]:
        """The step's record (`window`: the rest of `step_record`'s figures of the window),
        and this rank's figures of the window for the next one."""
        rss_mb = self.resident.mb()
        record = step_record(
            result,
            data_s=data_s,
            rss_mb=rss_mb,
            flops_per_item=self.flops_per_item or None,
            recompute_flops_per_item=self.recompute_flops,
            peak_tflops=self.peak_tflops,
            token_items=self.token_items,
            **window,
        )
        record[TIME_KEY] = time.time()
        self.noise.absorb(result.noise)
        if self.noise.smoothed is None:  # a run's first window: its own sums, reduced now
            self.settle_noise()
        if self.noise.value is not None:
            record["grad/noise_scale"] = self.noise.value
        # a pipeline stage's idle time is a wait for its neighbours, as a sync is for its peers
        idle = result.pipeline.idle_s if result.pipeline is not None else 0.0
        self.figures = rank_figures(
            step_s=result.step_time_s,
            sync_s=result.sync_time_s + idle,
            optimizer_s=result.optimizer_time_s,
            data_s=data_s,
            host_mb=rss_mb,
            device_mb=result.peak_memory_mb,
        )
        if self.node_sampler is not None:
            self.figures += self.node_sampler.figures()
        self.group_figures = result.group_figures
        return record

    def settle_noise(self) -> None:
        """The last window's estimate taken in now, where no next window of this group is sure
        to bring it (before a checkpoint keeps the smoothing); every rank calls it alike."""
        self.noise.absorb(self._settle())

    def handed(self, record: dict[str, Any]) -> dict[str, Any]:
        """The record as it goes to the driver: with every rank's figures, which are the
        driver's alone (not in the lineage, whose lines every step would lengthen)."""
        handed = dict(record)
        if self.group_figures:
            handed[FIGURES_KEY] = self.group_figures
        return handed
