"""What the planner asks of the FSDP wing: the modes and variants it tries (sync modes, shards
in host memory, HSDP across nodes), the memory `rayacc plan` shows per rank, its cost model for
the prior, and the config keys a candidate sets."""

from __future__ import annotations

from typing import Any

from rayacc.engine.parallel.base import CostShape, WingCost, sharded_cost
from rayacc.engine.units import GRAD_SYNC_MODES

__all__ = ["FSDPPlanning"]


class FSDPPlanning:
    """The FSDP wing's planner side (`Strategy`'s planner classmethods)."""

    name: str

    @classmethod
    def planner_modes(cls, job_strategy: str) -> list[dict[str, Any]]:
        return [{"strategy": cls.name, "grad_sync": g} for g in GRAD_SYNC_MODES]

    @classmethod
    def sharding_variants(cls, mode, nodes, workers) -> list[dict[str, Any]]:
        """The shards in host memory (offload) and, where the workers span nodes evenly, HSDP
        with one replica group per node (each shard group on one node's links)."""
        out = [mode]
        if mode["grad_sync"] == "every_micro_step":
            out.append({**mode, "offload": True})
        if nodes > 1 and workers % nodes == 0:
            out.append({**mode, "replicate": nodes})
        return out

    @classmethod
    def memory_rows(cls, params, workers, slots, activations, **layout):
        shard = params / workers
        if layout.get("pipelined"):  # a stage holds its gradients whole across the window
            return [(cls.name, shard, params, slots * shard, activations)]
        return [
            (f"{cls.name} every_micro_step", shard, shard, slots * shard, activations),
            (f"{cls.name} window_end", shard, params, slots * shard, activations),
        ]

    @classmethod
    def cost(cls, shape: CostShape) -> WingCost:
        """Shards over the shard group (crossing nodes unless HSDP keeps it in one), gathered
        each micro-step; `window_end` holds the whole gradients across the window; HSDP adds
        one all-reduce of the shards' gradients over the replica groups; offloaded shards
        live in host memory and cross the host link each micro-step."""
        P, s, a = shape.params, shape.shard_ranks, shape.micro_steps
        on_host = shape.offload and shape.gpu
        held = 0.0 if on_host else P / s
        grads = P if shape.grad_sync == "window_end" else held
        states = (0.0 if on_host else (1 + shape.slots) * P / s) + grads
        gathered, comm = sharded_cost(shape, s, shape.crosses and shape.replicate == 1)
        if shape.replicate > 1:
            comm += (P / s) * shape.allreduce(shape.replicate, shape.crosses)
            comm += shape.units * shape.latency_s
        if on_host:  # shards in (twice with resharding) and gradient shards out
            moves = (2 if shape.reshard_after_forward else 1) + 1
            comm += a * moves * (P / s) / shape.host_link
        return WingCost(states, gathered, comm if shape.workers > 1 else 0.0, s)

    @classmethod
    def candidate_overrides(cls, candidate) -> dict[str, Any]:
        return {
            "fsdp.grad_sync": candidate.grad_sync,
            "fsdp.replicate": candidate.replicate,
            "fsdp.offload": "cpu" if candidate.offload else "none",
        }
