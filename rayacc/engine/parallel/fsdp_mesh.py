"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for the accumulation step: sharding a model per
block and at the root, the two ways to accumulate, and counting the gradient reduce-scatters.

Parameters, gradients and optimizer state are sharded over the ranks (ZeRO-3). Accumulation:
- `every_micro_step`: each micro-step's backward reduce-scatters its gradients, so each rank
  holds only its shard of the accumulated gradient (least memory; one reduce-scatter per block
  and micro-step).
- `window_end`: `set_requires_gradient_sync(False)` on the window's other micro-steps: the
  unsharded gradients of every parameter are held across the window and reduce-scattered once
  (one reduce-scatter per block and window; a full gradient's memory on every rank).
Either way FSDP's gradient division is set to 1, so the reduction is a sum over ranks and the
engine's single multiply by 1 / N_window is the whole normalisation (docs/design.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from rayacc.engine.units import GRAD_SYNC_MODES, fsdp_blocks, is_fsdp

__all__ = [
    "GRAD_SYNC_MODES",
    "CountingReduceScatter",
    "MeshShape",
    "build_mesh",
    "drop_unsynced_grads",
    "fsdp_blocks",
    "is_fsdp",
    "materialize_shards",
    "mesh_shape",
    "node_mesh",
    "shard_model",
]


@dataclass(frozen=True)
class MeshShape:
    """The FSDP mesh of a group: `replicate` replica groups of `shard` ranks each (1 × W: the
    parameters sharded over every rank; R × S with R > 1: HSDP)."""

    replicate: int
    shard: int
    why: str = ""
    """How `replicate` was chosen, where the setting was `auto`."""

    def __str__(self) -> str:
        return f"{self.replicate} × {self.shard}"


def mesh_shape(replicate: int | str, nodes: Sequence[str]) -> MeshShape:
    """The mesh of a group whose rank r runs on node `nodes[r]`. `replicate`: a number of
    replica groups (it divides the group), or `auto`: one per node where every node holds the
    same number of ranks (each shard group then stays inside a node), else 1."""
    world = len(nodes)
    if replicate != "auto":
        if world % int(replicate):
            raise ValueError(
                f"fsdp.replicate={replicate} does not divide the group's {world} workers"
            )
        return MeshShape(int(replicate), world // int(replicate))
    per_node = Counter(nodes)
    counts = set(per_node.values())
    if len(per_node) > 1 and len(counts) == 1:
        return MeshShape(len(per_node), world // len(per_node), f"{len(per_node)} nodes")
    if len(per_node) == 1:
        return MeshShape(1, world, "one node")
    held = ", ".join(str(n) for n in per_node.values())
    return MeshShape(1, world, f"nodes hold unequal numbers of workers ({held})")


def build_mesh(device_type: str, shape: MeshShape, nodes: Sequence[str] | None = None):
    """The device mesh of `shape`: ranks ordered by node (nodes in the order of their first
    rank), so each run of `shard` ranks (a shard group: its all-gathers and reduce-scatters
    every micro-step) shares a node where the placement allows; the replicate dimension (one
    all-reduce per window) crosses the nodes."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if shape.replicate * shape.shard != world:
        raise ValueError(f"a {shape} mesh does not cover {world} ranks")
    if shape.replicate == 1:
        return init_device_mesh(device_type, (world,))
    nodes = list(nodes) if nodes else [str(r) for r in range(world)]
    return node_mesh(device_type, nodes, (shape.replicate, shape.shard), ("replicate", "shard"))


def node_mesh(
    device_type: str, nodes: Sequence[str], dims: tuple[int, ...], names: tuple[str, ...]
):
    """A mesh of `dims` over the ranks ordered by node (rank r runs on `nodes[r]`; nodes in
    the order of their first rank): the inner dimensions' groups (runs of consecutive ranks)
    share a node where the placement allows, the outer ones cross nodes."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.tensor(node_order(nodes), dtype=torch.int).reshape(*dims)
    return DeviceMesh(device_type, ranks, mesh_dim_names=names)


def node_order(nodes: Sequence[str]) -> list[int]:
    """The ranks node by node (nodes in the order of their first rank)."""
    first: dict[str, int] = {}
    for rank, node in enumerate(nodes):
        first.setdefault(node, rank)
    return sorted(range(len(nodes)), key=lambda r: (first[nodes[r]], r))


def groups_across_nodes(nodes: Sequence[str], size: int) -> int:
    """How many of `node_mesh`'s groups of `size` consecutive ranks (along its last
    dimension) span more than one node: where a node holds a count `size` does not divide."""
    order = node_order(nodes)
    groups = [order[i : i + size] for i in range(0, len(order), size)]
    return sum(len({nodes[r] for r in g}) > 1 for g in groups)


def shard_model(
    model: nn.Module,
    *,
    device: torch.device,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    blocks: Sequence[nn.Module] | None = None,
    mesh=None,
    offload: bool = False,
    placement: Callable[[nn.Parameter], object] | None = None,
) -> nn.Module:
    """`fully_shard` on each block, then on the root, over `mesh` (by default a 1-D mesh of
    all ranks on `device`'s type; a 2-D one, `build_mesh`, is HSDP). `param_dtype` (bf16)
    computes in that dtype and reduces gradients in float32. `offload`: the sharded
    parameters, their gradients and so the optimizer's state and step live in host memory
    (`CPUOffloadPolicy`; pinned only where a device is there to copy to). The model's
    parameters may be on the meta device (each rank then materialises only its shards) or on
    `device`. `placement`: FSDP's placement of a parameter where not its rows (None)."""
    from torch.distributed.device_mesh import init_device_mesh

    if mesh is None:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward, "mp_policy": policy}
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type != "cpu")
    if placement is not None:
        kwargs["shard_placement_fn"] = placement
    for block in fsdp_blocks(model) if blocks is None else blocks:
        fully_shard(block, **kwargs)
    # the reduction is made a sum by AccumulationStep, which owns the normalisation
    fully_shard(model, **kwargs)
    return model


@torch.no_grad()
def materialize_shards(
    model: nn.Module,
    device: torch.device,
    values: Callable[[str, torch.Size], torch.Tensor],
) -> nn.Module:
    """Gives a model sharded on the meta device its storage on `device`, each rank only its
    shards, and writes each rank's rows of `values(name, full_shape)` (a full CPU tensor: one
    parameter at a time is whole, never the model). The weights are then those of the unsharded
    model for any number of ranks. Buffers keep the values the module's own code gave them
    (a causal mask, rotary tables): `to_empty` would leave them uninitialised."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    buffers = {}
    for name, buf in model.named_buffers():
        if buf.is_meta:
            raise RuntimeError(
                f"buffer {name} was built on the meta device and has no value to materialise: "
                "build the module's buffers on a real device (only parameters go on meta)"
            )
        buffers[name] = buf.detach().clone()
    model.to_empty(device=device)
    for name, buf in model.named_buffers():
        buf.copy_(buffers[name])
    for name, param in model.named_parameters():
        full = values(name, param.shape)
        if isinstance(param, DTensor):
            local = param.to_local()
            # this rank's part as DTensor splits it (FSDP's rows as torch.chunk does, a
            # tensor-parallel split on its own dimension), cut from the full value here: no
            # collective
            part = distribute_tensor(
                full, param.device_mesh, param.placements, src_data_rank=None
            ).to_local()
            if part.shape != local.shape:
                raise RuntimeError(
                    f"parameter {name}: this rank holds {tuple(local.shape)} of "
                    f"{tuple(full.shape)}, not the part {tuple(part.shape)} its placements "
                    f"{param.placements} give"
                )
            local.copy_(part)
        else:
            param.copy_(full)
    return model


def drop_unsynced_grads(units: Iterable[nn.Module]) -> None:
    """Drops the unsharded gradients FSDP2 keeps inside its `units` (the modules `fully_shard`
    was applied to) after a backward that did not reduce-scatter
    (`set_requires_gradient_sync(False)`): the next synced backward adds them to its own.
    `zero_grad` clears only the sharded ones."""
    # FSDP2 has no public call for this: its parameter group's private state (torch 2.13);
    # tests/distributed/test_strategy.py fails if that moves
    for module in units:
        group = module._get_fsdp_state()._fsdp_param_group
        if group is not None:
            # HSDP: what the window's micro-steps reduce-scattered without all-reducing
            group._partial_reduce_output = None
        for fsdp_param in group.fsdp_params if group is not None else ():
            fsdp_param.unsharded_accumulated_grad = None
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                unsharded.grad = None


class CountingReduceScatter(ReduceScatter):
    """FSDP's reduce-scatter of gradients (the default collective), counted and timed on
    `timeline` (launched / done, see engine/parallel/). Installed on every FSDP unit."""

    def __init__(self, timeline) -> None:
        from rayacc.engine.noise import LocalGradients

        self.timeline = timeline
        self.local = LocalGradients()
        """Each unit's gradient sum before it is reduced (the noise scale's small batches)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        self.local.observe(input_tensor)
        self.timeline.launched()
        work = dist.reduce_scatter_single(
            output=output_tensor, input=input_tensor, op=op, group=group, async_op=async_op
        )
        if work is None:
            self.timeline.done()
        else:
            work.get_future().then(self.timeline.done)
        return work
