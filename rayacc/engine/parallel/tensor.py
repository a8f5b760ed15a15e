"""Tensor parallelism: a model's linear layers split over the ranks of a tensor-parallel group
(DTensor's `ColwiseParallel` / `RowwiseParallel`, the layout torchtitan trains with), composed
with FSDP2's sharding over the data-parallel dimension of a 2-D mesh (`dp`, `tp`). The model
declares its plan (`tp_plan()`: module paths → styles); the state dict keeps its names and
global shapes, so a checkpoint does not depend on the mesh it was written from.

More: docs/design.md, "Tensor parallelism".
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode

from rayacc.engine.parallel.base import GroupCalls

__all__ = [
    "CountCollectives",
    "FusedColwise",
    "apply_plan",
    "fsdp_placement",
    "grad_norm",
    "tp_plan",
]

_KINDS = {
    "all_reduce": "allreduce",
    "all_reduce_coalesced": "allreduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
}
"""DTensor's collectives (torch's functional collectives, `_c10d_functional`) by kind."""


class FusedColwise(ParallelStyle):
    """A linear whose output is `parts` outputs side by side (attention's fused q, k, v): each
    rank of the group holds its share of every part (its heads' q, k and v), so the parts
    split as the unfused layers would. The weight's rows are sharded part by part
    (`_StridedShard`), the bias replicated and cut to the same share in forward (the cut is
    local; its gradient is gathered in backward)."""

    def __init__(self, parts: int) -> None:
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise ValueError(f"FusedColwise applies to a Linear, not {type(module).__name__}")
        strided = [_StridedShard(0, split_factor=self.parts)]
        module.weight = nn.Parameter(distribute_tensor(module.weight, device_mesh, strided))
        if module.bias is not None:
            module.bias = nn.Parameter(distribute_tensor(module.bias, device_mesh, [Replicate()]))

        def forward(x: torch.Tensor) -> torch.Tensor:
            # the input is the same on every rank of the group; its gradient, a sum over them
            given = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            out = F.linear(given, module.weight).to_local()
            if module.bias is None:
                return out
            return out + module.bias.redistribute(device_mesh, strided).to_local()

        module.forward = forward
        return module


class CountCollectives(TorchDispatchMode):
    """Counts the collectives DTensor runs over the ranks of `group` while it is entered,
    forward and backward (autograd carries the mode to its threads). Every op passes through
    it: it is entered for one micro-step, not every one. A group is known by its ranks: DTensor
    may run a layer's collective on an equal mesh's group made earlier in the process."""

    def __init__(self, group) -> None:
        super().__init__()
        self.ranks = tuple(dist.get_process_group_ranks(group))
        self.counts: Counter[str] = Counter()
        self._ours: dict[str, bool] = {}

    def _is_ours(self, name: str) -> bool:
        if name not in self._ours:
            group = _resolve_process_group(name)
            self._ours[name] = tuple(dist.get_process_group_ranks(group)) == self.ranks
        return self._ours[name]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            # DTensor first: the collectives it turns the op into come back here (a mode
            # runs before a subclass, and is off while it handles an op)
            return NotImplemented
        kind = _KINDS.get(func._overloadpacket.__name__)
        if kind is not None and func.namespace == "_c10d_functional":
            name = kwargs.get("group_name", args[-1] if args else None)
            if isinstance(name, str) and self._is_ours(name):
                self.counts[kind] += 1
        return func(*args, **kwargs)

    def calls(self) -> GroupCalls:
        return GroupCalls(**self.counts)


def tp_plan(module: nn.Module) -> dict[str, ParallelStyle]:
    """The tensor-parallel plan the model declares (module paths, `*` for any index → the
    style of each); a ValueError naming the model when it declares none."""
    plan = getattr(module, "tp_plan", None)
    if plan is None:
        raise ValueError(
            f"{type(module).__name__} declares no tensor-parallel plan (a `tp_plan()` method "
            "naming the style of each of its linear layers): it cannot be split over a "
            "tensor-parallel group"
        )
    return plan()


def apply_plan(module: nn.Module, tp_mesh, plan: dict[str, ParallelStyle]) -> nn.Module:
    """The plan's styles applied on the `tp` mesh (before FSDP shards over `dp`)."""
    return parallelize_module(module, tp_mesh, plan)


def fsdp_placement(param: nn.Parameter) -> Shard | None:
    """FSDP2's placement of a parameter on the data-parallel dimension: a weight split part
    by part over `tp` is sharded on its columns (FSDP's rows would cut across the parts);
    None: FSDP's own (rows)."""
    placements = getattr(param, "placements", ())
    if param.ndim == 2 and any(isinstance(p, _StridedShard) for p in placements):
        return Shard(1)
    return None


def grad_norm(grads: list[Any]) -> torch.Tensor:
    """The 2-norm over all the gradients of the ranks, its parts grouped by the mesh each
    lives on (a norm's reduction does not mix meshes): the full gradient's norm on every
    rank."""
    groups: dict[Any, list[Any]] = {}
    for g in grads:
        groups.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    squares = 0.0
    for grouped in groups.values():
        norm = torch.nn.utils.get_total_norm(grouped)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares += float(norm) ** 2
    return torch.tensor(math.sqrt(squares))
