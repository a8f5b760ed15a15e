"""Every collective of the package, on the process group's device.

Ray Train runs NCCL when `scaling.use_gpu` is set, and NCCL takes CUDA tensors only; gloo takes
CPU tensors. A count or a metric built on the host is moved to the group's device here, reduced,
and handed back on the device it came from. Gradient buckets are on the right device by
construction. `tests/unit/engine/test_collectives.py` fails when a module of the package calls
torch.distributed's collectives anywhere else.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "all_gather_into",
    "all_gather_objects",
    "all_reduce",
    "all_reduce_async",
    "distributed",
    "group_device",
]

_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def distributed(group: dist.ProcessGroup | None = None) -> bool:
    """True when a process group of more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where the group's collectives take their tensors: this rank's GPU for NCCL, else the
    CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(
    tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """`tensor` reduced over the ranks, on the device it came from (the input itself when it
    already was on the group's device: reduced in place). Without a group of several ranks,
    the input unchanged."""
    if not distributed(group):
        return tensor
    device = group_device(group)
    on_group = tensor if tensor.device == device else tensor.to(device)
    dist.all_reduce(on_group, op=_OPS[op], group=group)
    return on_group if on_group is tensor else on_group.to(tensor.device)


def all_reduce_async(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> dist.Work:
    """An in-place sum over the ranks, launched and not waited for; `tensor` must be on the
    group's device already (gradient buckets are)."""
    return dist.all_reduce(tensor, group=group, async_op=True)


def all_gather_into(
    output: torch.Tensor, part: torch.Tensor, group: dist.ProcessGroup | None = None
) -> None:
    """Every rank's `part` into `output` (world size × `part`, in rank order); both on the
    group's device (the planner times this collective: no copies inside)."""
    device = group_device(group)
    if output.device != device or part.device != device:
        raise ValueError(f"all_gather_into takes tensors on {device}, got {output.device}")
    dist.all_gather_into_tensor(output, part, group=group)


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's `obj`, in rank order (a list of one without a group of several ranks)."""
    if not distributed(group):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
