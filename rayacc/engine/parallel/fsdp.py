"""FSDP: parameters, gradients and optimizer state sharded over the ranks (FSDP2)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from rayacc.engine.collectives import all_gather_objects, all_reduce
from rayacc.engine.parallel.base import (
    CommStats,
    Contract,
    GroupCalls,
    ModelRecipe,
    Strategy,
    _checkpoint_blocks,
    _Timeline,
    _world,
)
from rayacc.engine.parallel.fsdp_plan import FSDPPlanning
from rayacc.engine.parallel.state import ShardedState
from rayacc.engine.units import GRAD_SYNC_MODES, fsdp_blocks, is_fsdp

if TYPE_CHECKING:
    from rayacc.engine.parallel.fsdp_mesh import MeshShape

__all__ = ["FSDP"]


class FSDP(FSDPPlanning, Strategy):
    """Parameters, gradients and optimizer state sharded over the ranks (FSDP2 `fully_shard`
    per block, then at the root). `grad_sync`: `every_micro_step` reduce-scatters after every
    micro-step (least memory); `window_end` holds the unsharded gradients across the window and
    reduce-scatters once.

    `replicate` > 1 (or `auto`: one replica group per node) is HSDP: a 2-D mesh, the
    parameters sharded inside each replica group and replicated across them. The sharded
    gradients are all-reduced across the replica groups once per window in either mode (the
    window's other micro-steps reduce-scatter only, `set_requires_all_reduce(False)`, or not at
    all under `window_end`). `node`: this rank's node (the group's placement, gathered at build,
    lays the shard groups inside nodes). `offload`: state in host memory (`CPUOffloadPolicy`).
    `tensor_parallel` > 1: a (`dp`, `tp`) mesh (engine/parallel/tensor.py)."""

    name = "fsdp"
    state_format = ShardedState
    min_workers = 2

    @classmethod
    def from_config(cls, cfg, split, user=None, node=None) -> FSDP:
        f = cfg.fsdp
        bf16 = cfg.train.precision == "bf16" and f.mixed_precision
        return cls(
            f.grad_sync,
            reshard_after_forward=f.reshard_after_forward,
            param_dtype=torch.bfloat16 if bf16 else None,
            replicate=f.replicate,
            node=node,
            offload=f.offload == "cpu",
            tensor_parallel=cfg.mesh.tensor,
            pipeline_parallel=cfg.mesh.pipeline,
            pipeline_schedule=cfg.mesh.schedule,
            stages_per_rank=cfg.mesh.looped,
            pipeline_shape=(split.grad_accum_steps, split.micro_batch_size) if split else None,
        )

    @classmethod
    def describe(cls, cfg) -> str:
        f = cfg.fsdp
        where = {1: "sharded", "auto": "sharded inside each node, replicated across nodes"}
        sharded = where.get(f.replicate, f"sharded inside {f.replicate} replica groups (HSDP)")
        offload = "; in host memory (offload cpu)" if f.offload == "cpu" else ""
        mesh = cfg.mesh
        tp, pp = mesh.tensor, mesh.pipeline
        split = f"; each layer split over {tp} ranks (tensor parallel)" if tp > 1 else ""
        sync = f"grad_sync {f.grad_sync}"
        if pp > 1:
            m = cfg.batch_split().grad_accum_steps
            bubble = mesh.bubble(m)
            short = f": accumulation {m} < {pp} stages" if m < pp else ""
            split += (f"; the layers cut into {pp} pipeline stages, {mesh.schedule}"
                     f" schedule, idle share {bubble:.0%}{short}")  # fmt: skip
            sync = "gradients reduced once per window (each stage after its last backward)"
        return (
            f"FSDP2 (parameters, gradients and optimizer state {sharded}{offload}{split}; "
            f"{sync}, reshard_after_forward {str(f.reshard_after_forward).lower()})"
        )

    def __init__(
        self,
        grad_sync: str = "every_micro_step",
        *,
        reshard_after_forward: bool = True,
        param_dtype: torch.dtype | None = None,
        replicate: int | str = 1,
        node: str | None = None,
        offload: bool = False,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        pipeline_schedule: str = "1f1b",
        stages_per_rank: int = 2,
        pipeline_shape: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.tensor_parallel = tensor_parallel
        self.pipeline_parallel = pipeline_parallel
        self.pipeline_schedule = pipeline_schedule
        self.stages_per_rank = stages_per_rank
        self.pipeline_shape = pipeline_shape
        """A window's micro-batches and a micro-batch's rows (the split's; None: the first
        window's)."""
        self.pipeline = None
        """The stages this rank runs and their schedule (engine/parallel/pipeline.py; set at
        build when `pipeline_parallel` > 1)."""
        self._dp_group = None
        """The data-parallel ranks' group under tensor parallelism (set at build)."""
        self._tp_group = None
        self._grid = None  # the (replicate, shard or dp, tp) mesh under tensor parallelism
        self._reduce_scatter = None  # counted reduce-scatters: their probe of the gradients
        self._tp_across = 0
        """Tensor-parallel groups whose ranks the placement put on more than one node."""
        self._tp_repeating: GroupCalls | None = None
        """The tensor-parallel collectives of the unit that repeats, measured once: a
        micro-step (a window repeats it `micro_steps` times), or a pipeline's whole window (its
        first, whose stages infer their shapes with extra forwards, passed over)."""
        self._pipeline_windows = 0
        self._tp_norm = GroupCalls()
        self.replicate = replicate
        self.node = node
        self.offload = offload
        self.mesh: MeshShape | None = None
        """The mesh the group got (set at build)."""
        self._all_reduces = 0
        if grad_sync not in GRAD_SYNC_MODES:
            raise ValueError(f"grad_sync={grad_sync!r} is not one of {', '.join(GRAD_SYNC_MODES)}")
        self.grad_sync = grad_sync
        self.contract = Contract(
            lockstep=True,
            # a peer may be waiting in a gather or reduce-scatter this rank will never join
            retries_out_of_memory=False,
            # the fused SGD kernel has no rule for sharded (DTensor) parameters
            fused_sgd=False,
            gathers_in_forward=True,
            # a pipeline's stages reduce their gradients once, after the window's last backward
            holds_whole_gradients=grad_sync == "window_end" or pipeline_parallel > 1,
            pipelined=pipeline_parallel > 1,
        )
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = param_dtype
        self._timeline = _Timeline()
        self.counted = False
        self._unit_list: list[nn.Module] | None = None
        self.state = ShardedState()

    def _build(self, recipe: ModelRecipe, device: torch.device) -> nn.Module:
        from rayacc.engine.parallel.fsdp_mesh import (
            build_mesh,
            groups_across_nodes,
            materialize_shards,
            mesh_shape,
            node_mesh,
            node_order,
            shard_model,
        )

        if self.pipeline_parallel > 1:
            return self._build_pipeline(recipe, device)
        module = recipe.build_on_meta() if recipe.build_on_meta else recipe.build()
        plan = None
        if self.tensor_parallel > 1:
            from rayacc.engine.parallel.tensor import tp_plan

            plan = tp_plan(module)
        values = None
        if any(p.is_meta for p in module.parameters()):
            values = recipe.initial_values(module) if recipe.initial_values else None
            if values is None:
                # no rule for each parameter's start: built whole on every rank, then sharded
                module = recipe.build()
        _checkpoint_blocks(module, recipe)
        if recipe.compile:
            # each block compiled in place before it is sharded (names, and so checkpoints,
            # stay): FSDP's gathers and reduce-scatters run between the compiled blocks
            for block in fsdp_blocks(module):
                block.compile()
        if values is None:
            module = module.to(device)
        nodes = self._placement()
        placement = None
        if plan is not None:
            from rayacc.engine.parallel.tensor import apply_plan, fsdp_placement

            world, tp = _world(), self.tensor_parallel
            if world % tp:
                raise ValueError(f"tensor_parallel={tp} does not divide the group's {world} ranks")
            # HSDP's replica groups over the tensor-parallel groups (each on its first rank's node)
            order = node_order(nodes)
            self.mesh = mesh_shape(self.replicate, [nodes[r] for r in order[::tp]])
            # each tensor-parallel group (one all-reduce per layer) on a node where it can be
            self._tp_across = groups_across_nodes(nodes, tp)
            placement = fsdp_placement
            if self.mesh.replicate == 1:
                grid = node_mesh(device.type, nodes, (world // tp, tp), ("dp", "tp"))
                mesh = dp = grid["dp"]
            else:
                shape = (self.mesh.replicate, self.mesh.shard, tp)
                grid = node_mesh(device.type, nodes, shape, ("replicate", "shard", "tp"))
                mesh = grid["replicate", "shard"]
                dp = mesh._flatten("dp")  # the counts' group: every data-parallel rank
            apply_plan(module, grid["tp"], plan)
            self._dp_group = dp.get_group()
            self._tp_group = grid["tp"].get_group()
            self._grid = grid
        else:
            self.mesh = mesh_shape(self.replicate, nodes)
            mesh = build_mesh(device.type, self.mesh, nodes)
        shard_model(
            module,
            device=device,
            reshard_after_forward=self.reshard_after_forward,
            param_dtype=self.param_dtype,
            mesh=mesh,
            offload=self.offload,
            placement=placement,
        )
        if values is not None:
            # offloaded shards live in host memory from the start
            materialize_shards(module, torch.device("cpu") if self.offload else device, values)
        return module

    def _build_pipeline(self, recipe: ModelRecipe, device: torch.device) -> nn.Module:
        """This rank's stages of the model, each sharded over its stage's data-parallel ranks."""
        from rayacc.config.mesh import Mesh
        from rayacc.engine.parallel.fsdp_mesh import mesh_shape, node_order, shard_model
        from rayacc.engine.parallel.pipeline import build_pipeline

        nodes = self._placement()
        # HSDP's replica groups over a stage's data-parallel ranks (the first stage's nodes)
        stage_ranks = node_order(nodes)[: _world() // self.pipeline_parallel]
        self.mesh = mesh_shape(
            self.replicate, [nodes[r] for r in stage_ranks[:: self.tensor_parallel]]
        )

        def shard(stage: nn.Module, mesh, placement) -> None:
            _checkpoint_blocks(stage, recipe)
            for block in fsdp_blocks(stage) if recipe.compile else ():
                block.compile()  # each block in place before it is sharded, as below
            if mesh is not None:
                shard_model(stage, device=device, reshard_after_forward=self.reshard_after_forward,
                            param_dtype=self.param_dtype, mesh=mesh, offload=self.offload,
                            placement=placement)  # fmt: skip

        per_rank = Mesh(self.pipeline_parallel, schedule=self.pipeline_schedule,
                        looped=self.stages_per_rank).stages_per_rank  # fmt: skip
        part, self.pipeline, self._grid = build_pipeline(
            recipe, device, nodes, self.pipeline_parallel, self.pipeline_schedule, per_rank,
            shard, self.pipeline_shape, self.tensor_parallel, self.mesh.replicate)  # fmt: skip
        data = ("replicate", "shard") if self.hsdp else ("dp",)
        grid = self._grid[data]
        self._data_group = (grid._flatten("data") if self.hsdp else grid).get_group()
        if self.tensor_parallel > 1:
            # the window's counts over every stage's data-parallel ranks, once per tp group
            self._dp_group = self._grid[("pp", *data)]._flatten("pp_dp").get_group()
            self._tp_group = self._grid["tp"].get_group()
        return part

    def run_pipeline(self, micro_batches, loss_fn, train=True):
        if not train:
            return self.pipeline.run(micro_batches, loss_fn, train)
        self._pipeline_windows += 1
        counting = self.counted and self._tp_group is not None and self._pipeline_windows == 2
        with (
            self._count_tensor_parallel(self._keep_repeating)
            if counting
            else contextlib.nullcontext()
        ):
            return self.pipeline.run(micro_batches, loss_fn, train)

    def _placement(self) -> list[str]:
        """Each rank's node, gathered (a collective at build: every rank builds)."""
        world = _world()
        alone = self.replicate == 1 and self.tensor_parallel == 1 and self.pipeline_parallel == 1
        if alone or world == 1:
            return [self.node or ""] * world
        import socket

        return [str(n) for n in all_gather_objects(self.node or socket.gethostname())]

    @property
    def process_group(self):
        """Under tensor parallelism the data-parallel ranks' group: the window's counts are
        summed over it (each tensor-parallel group reads the same rows)."""
        return self._dp_group

    @property
    def data_group(self):
        """A pipeline's stages read the same rows: the data-parallel ranks of one stage."""
        return self._data_group if self.pipeline is not None else self.process_group

    @property
    def pipeline_window(self) -> tuple[int, int] | None:
        p = self.pipeline
        return (p.micro_steps, p.rows) if p is not None and p.micro_steps else None

    @property
    def holds_loss(self) -> bool:
        return self.pipeline is None or self.pipeline.holds_loss

    @property
    def figures_group(self):
        return self._tp_group

    def mesh_coordinates(self) -> tuple[tuple[tuple[str, int], ...], ...]:
        if self._grid is None:
            return ()
        ranks, names = self._grid.mesh, self._grid.mesh_dim_names
        places: dict[int, tuple[tuple[str, int], ...]] = {}
        for index in itertools.product(*map(range, ranks.shape)):
            places[int(ranks[index])] = tuple(zip(names, index, strict=True))
        return tuple(places[r] for r in sorted(places))

    def describe_mesh(self) -> str:
        if self.pipeline is not None:  # FSDP × PP mesh 2 × 2 (pp × dp), × TP with `tp`
            names, grid = self._grid.mesh_dim_names, " × ".join(map(str, self._grid.mesh.shape))
            label = " × ".join(n.upper() for n in names if n in ("pp", "tp"))
            kind = "HSDP" if self.hsdp else "FSDP"
            return f"{kind} × {label} mesh {grid} ({' × '.join(names)}); {self.pipeline.describe()}"
        if self.tensor_parallel > 1 and self.mesh is not None:
            across = ""
            if self._tp_across:
                # the placement filled a node with a count T does not divide
                across = (f"; {self._tp_across} tensor-parallel group(s) across nodes: their "
                          "per-layer collectives run over the links between them")  # fmt: skip
            if self.hsdp:
                return (f"HSDP × TP mesh {self.mesh} × {self.tensor_parallel} (replica groups × "
                        f"ranks sharding each × tp){across}")  # fmt: skip
            return f"FSDP × TP mesh {self.mesh.shard} × {self.tensor_parallel} (dp × tp){across}"
        if self.mesh is None or self.replicate == 1:
            return ""
        why = f"; replicate auto: {self.mesh.why}" if self.mesh.why else ""
        return f"FSDP mesh {self.mesh} (replica groups × ranks sharding each{why})"

    @property
    def hsdp(self) -> bool:
        return self.mesh is not None and self.mesh.replicate > 1

    def adopt(self, model: nn.Module) -> Strategy:
        if not is_fsdp(model):
            raise ValueError("the FSDP strategy needs a model sharded with fully_shard")
        return super().adopt(model)

    def _units(self) -> list[nn.Module]:
        if self._unit_list is None:
            roots = self.pipeline.modules if self.pipeline is not None else [self.model]
            seen = {id(m): m for root in roots for m in root.modules() if is_fsdp(m)}
            self._unit_list = list(seen.values())
        return self._unit_list

    def setup_reduction(self, count_comm: bool) -> bool:
        from rayacc.engine.parallel.fsdp_mesh import CountingReduceScatter

        for unit in self._units():
            # a sum over ranks: the step's multiply by 1 / N is the whole normalisation
            unit.set_gradient_divide_factor(1.0)
            # a plain SUM (not NCCL's PreMulSum by 1, which gloo lacks)
            unit.set_force_sum_reduction_for_comms(True)
        self.counted = count_comm
        if count_comm:
            reduce_scatter = self._reduce_scatter = CountingReduceScatter(self._timeline)
            for unit in self._units():
                unit.set_custom_reduce_scatter(reduce_scatter)
                if self.hsdp:
                    # under HSDP FSDP2 calls it after each all-reduce across the replica groups
                    # (a reduce-scatter that did not all-reduce returns before it)
                    unit.set_all_reduce_hook(self._all_reduced)
        return True

    def local_gradients(self):
        # under tensor parallelism a rank holds a shard of each layer's gradient: not measured
        counting = self._reduce_scatter
        measured = self.tensor_parallel == 1 and self.pipeline_parallel == 1
        return counting.local if counting is not None and measured else None

    def _all_reduced(self, _: torch.Tensor) -> None:
        self._all_reduces += 1
        self._timeline.done()

    def sync_context(self, sync: bool) -> contextlib.AbstractContextManager[None]:
        # FSDP2's forward gathers and its backward reduce-scatters per unit; a DDP-style
        # `no_sync` would do nothing. With `every_micro_step` every backward reduce-scatters;
        # under HSDP only the window's last all-reduces across the replica groups (the others'
        # reduce-scattered shards are summed inside FSDP until it does)
        if self.grad_sync == "window_end":
            self.model.set_requires_gradient_sync(sync)
        elif self.hsdp:
            self.model.set_requires_all_reduce(sync)
        if self.counted and self._tp_group is not None and self._tp_repeating is None:
            return self._count_tensor_parallel(self._keep_repeating)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _count_tensor_parallel(self, keep: Callable[[GroupCalls], None]) -> Iterator[None]:
        """Counts the tensor-parallel group's collectives inside; `keep` takes the count."""
        from rayacc.engine.parallel.tensor import CountCollectives

        with CountCollectives(self._tp_group) as counter:
            yield
        keep(counter.calls())

    def _keep_repeating(self, calls: GroupCalls) -> None:
        self._tp_repeating = calls

    def _add_norm(self, calls: GroupCalls) -> None:
        self._tp_norm = self._tp_norm + calls

    def agree_forwards(self, n: int, group=None) -> int:
        if _world() == 1:
            return n
        return int(all_reduce(torch.tensor([float(n)]), op="max", group=group).item())

    def grad_norm(self, grads: list[torch.Tensor], uniform: bool) -> torch.Tensor:
        if self.pipeline is not None:
            grads = self.pipeline.tied_once(grads)
        if self.tensor_parallel > 1:
            from rayacc.engine.parallel import tensor

            counted = self.counted and self._tp_group is not None
            with (
                self._count_tensor_parallel(self._add_norm) if counted else contextlib.nullcontext()
            ):
                norm = tensor.grad_norm(grads)  # parts on the 2-D mesh and on `dp` alone
        else:
            # the sharded gradients' norms combined over the ranks: a collective
            norm = torch.nn.utils.get_total_norm(grads)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        # a pipeline's stages: their norms combined over the stages
        return norm if self.pipeline is None else self.pipeline.grad_norm(norm)

    def discard_grads(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        super().discard_grads(optimizer)
        from rayacc.engine.parallel.fsdp_mesh import drop_unsynced_grads

        # a backward that did not reduce-scatter leaves unsharded gradients inside FSDP, which
        # the next synced backward would add to its own
        drop_unsynced_grads(self._units())

    def restore_sync(self) -> None:
        roots = self.pipeline.modules if self.pipeline is not None else [self.model]
        for root in filter(is_fsdp, roots):  # a stage alone on its rank is not sharded
            root.set_requires_gradient_sync(True)
            root.set_requires_all_reduce(True)

    def begin_window(self) -> None:
        self._timeline.begin_window()
        self._all_reduces = 0
        self._tp_norm = GroupCalls()

    def comm_stats(self, micro_steps: int) -> CommStats:
        synced = 0
        if _world() > 1:
            synced = micro_steps if self.grad_sync == "every_micro_step" else 1
        if self.pipeline is not None:
            synced = 1 if _world() > self.pipeline_parallel else 0
        if not self.counted:
            return CommStats(sync_passes=synced)
        tp = None
        if self._tp_group is not None and self.pipeline is None:
            tp = (self._tp_repeating or GroupCalls()) * micro_steps + self._tp_norm
        elif self._tp_group is not None and self._tp_repeating is not None:
            tp = self._tp_repeating + self._tp_norm  # the pipeline's window repeats once
        return CommStats(
            allreduce_calls=self._all_reduces,
            reduce_scatter_calls=self._timeline.launches,
            sync_passes=synced,
            sync_time_s=self._timeline.span_s(),
            tensor_parallel=tp,
            pipeline=self.pipeline.stats() if self.pipeline is not None else None,
        )
