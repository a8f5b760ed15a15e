"""Whether the cluster can ever hold the worker group, checked before launching: Ray Train
waits forever, without a word, for resources no node offers."""

from __future__ import annotations

import math
from typing import Any

from rayacc.config import TrainConfig

__all__ = ["ResourceError", "check_resources", "worker_needs", "workers_that_fit"]


class ResourceError(ValueError):
    """The request can never be met by the cluster as it is: names what is missing and the fix."""


def worker_needs(cfg: TrainConfig) -> dict[str, float]:
    """What one training worker asks Ray for."""
    s = cfg.scaling
    return {"CPU": s.cpus_per_worker, **({"GPU": 1.0} if s.use_gpu else {}), **s.extra_resources}


def workers_that_fit(nodes: list[dict[str, float]], need: dict[str, float]) -> int:
    """How many workers the nodes' total resources hold (each worker on one node)."""
    fit = 0
    for resources in nodes:
        fit += min(
            (math.floor(resources.get(k, 0.0) / v + 1e-9) if v > 0 else 10**9)
            for k, v in need.items()
        )
    return fit


def check_resources(cfg: TrainConfig, nodes: list[dict[str, Any]], may_grow: bool) -> str | None:
    """Raises ResourceError when the alive `nodes` (as `ray.nodes()` lists them) can never hold
    `scaling.num_workers`' minimum; with `may_grow` (a cluster that may add nodes) returns the
    same finding as a warning instead. None when the group fits."""
    need = worker_needs(cfg)
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", True)]
    fit = workers_that_fit(alive, need)
    wanted = cfg.scaling.min_workers
    if fit >= wanted:
        return None
    offered = sorted({k for r in alive for k in r if not k.startswith(("node:", "accelerator_"))})
    missing = [k for k in need if not any(r.get(k, 0) >= need[k] for r in alive)]
    asked = ", ".join(f"{k}: {v:g}" for k, v in need.items())
    text = (
        f"the worker group needs {wanted} worker(s) of {{{asked}}} (scaling.num_workers, "
        f"scaling.cpus_per_worker, scaling.use_gpu, scaling.extra_resources); the cluster's "
        f"{len(alive)} node(s) hold {fit}"
        + (f", and no node offers enough {', '.join(missing)}" if missing else "")
        + f" (resources offered: {', '.join(offered)}). Fix: "
        + _fix(cfg, missing)
    )
    if may_grow:
        return text
    raise ResourceError(text)


def _fix(cfg: TrainConfig, missing: list[str]) -> str:
    if "GPU" in missing:
        return "set scaling.use_gpu=false, or run on a cluster with GPU nodes"
    if any(k in cfg.scaling.extra_resources for k in missing):
        return (
            "remove scaling.extra_resources, or start nodes that offer them (cluster/local.sh "
            "gives each node a worker_slot) and set RAY_ADDRESS"
        )
    return "lower scaling.num_workers or scaling.cpus_per_worker, or add nodes"
