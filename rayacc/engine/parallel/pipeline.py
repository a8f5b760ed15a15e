"""Pipeline parallelism: a model's units (embeddings, blocks, head) cut into stages over the
ranks of a pipeline group, and a window's micro-batches run through them by one of
`torch.distributed.pipelining`'s schedules — the schedule's micro-batches are the window's
micro-steps, so a window is one schedule step and one optimizer step.

The one normalisation rule holds as everywhere: the last stage back-propagates each
micro-batch's item-loss sum (`scale_grads=False`), the stages' gradients stay sums, and the
accumulation step multiplies by 1 / N_window once. Only the last stage sees the losses and
counts the items: the window's statistics are summed over every rank of every stage, the
others adding zeros (docs/design.md, "Pipeline parallelism").
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from rayacc.config.mesh import idle_share, scheduled_micro_steps
from rayacc.config.parallel import ZBV_SHARDED
from rayacc.engine.collectives import all_reduce
from rayacc.engine.losses import IGNORE_INDEX, Batch, LossFn, summed
from rayacc.engine.parallel.base import PipelineStats

__all__ = [
    "Pipeline",
    "balanced_runs",
    "shallow_copy",
    "stage_indices",
]


_LOOPED = ("interleaved_1f1b", "zbv")


def stage_indices(schedule: str, pp_rank: int, pp: int, per_rank: int) -> list[int]:
    """The stages rank `pp_rank` of the pipeline group runs: a loop (rank r: r, r + P, …) or
    ZBV's V (rank r: r and 2P − 1 − r, so the first and last stage share rank 0)."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def balanced_runs(weights: Sequence[int], parts: int) -> list[range]:
    """`weights`' indices cut into `parts` contiguous non-empty runs whose largest sum is as
    small as it can be (the slowest stage sets the pipeline's pace)."""
    n = len(weights)
    if not 0 < parts <= n:
        raise ValueError(f"{n} units cannot make {parts} pipeline stages (each needs one)")
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    # best[k][i]: the least largest sum cutting the first i units into k runs
    best = [[math.inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                if worst < best[k][i]:
                    best[k][i], cut[k][i] = worst, j
    runs, i = [], n
    for k in range(parts, 0, -1):
        runs.append(range(cut[k][i], i))
        i = cut[k][i]
    return runs[::-1]


class _TimedStage(PipelineStage):
    """A stage that adds up the time it computes (its chunks' forwards and backwards, its
    gradients' reduction) and counts the tensors it sends to another rank."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.busy_s = 0.0
        self.sends = 0

    def _timed(self, call, *args, **kwargs):
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - start

    def forward_one_chunk(self, *args, **kwargs):
        return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_weight_one_chunk, *args, **kwargs)

    def perform_reduce_grad(self, *args, **kwargs):
        return self._timed(super().perform_reduce_grad, *args, **kwargs)

    def get_fwd_send_ops(self, *args, **kwargs):
        ops = super().get_fwd_send_ops(*args, **kwargs)
        self.sends += len(ops)
        return ops

    def get_bwd_send_ops(self, *args, **kwargs):
        ops = super().get_bwd_send_ops(*args, **kwargs)
        self.sends += len(ops)
        return ops


class _Output(nn.Module):
    """Stands for the model in a loss function on the last stage: what the schedule's forward
    gave, whatever it is called with (the loss functions call the model on their batch)."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.output


class Pipeline:
    """The stages this rank runs (`stages`: modules cut from the model, whole-model names)
    over the pipeline group `group`, and the schedule that runs a window through them.

    Every window is padded to one shape (`shape`: micro-batches × rows, each row the model's
    `width`: a stage's buffers are sized once); the loss sees each micro-batch as given, the
    padding cut off its output."""

    def __init__(
        self,
        stages: Sequence[nn.Module],
        indices: Sequence[int],
        n_stages: int,
        schedule: str,
        group: dist.ProcessGroup,
        device: torch.device,
        width: int,
        runs: Sequence[range],
        tied: dict[str, dict[str, nn.Parameter]] | None = None,
        tied_shapes: dict[str, tuple[torch.Size, torch.dtype]] | None = None,
        shape: tuple[int, int] | None = None,
    ) -> None:
        self.schedule = schedule
        self.group = group
        self.width = width
        self.n_stages = n_stages
        steps, self.rows = shape or (0, 0)
        self.micro_steps = scheduled_micro_steps(schedule, n_stages // len(indices), steps)
        """Micro-batches per window the schedule runs (0: the first window's) — a looped
        schedule's count may hold fillers — and rows per micro-batch (0: the first window's)."""
        self.indices = list(indices)
        self.runs = list(runs)
        """Every stage's units (`pipeline_units`' indices), in stage order."""
        self.stages = [
            _TimedStage(m, i, n_stages, device, group=group)
            for m, i in zip(stages, indices, strict=True)
        ]
        self.modules = list(stages)
        self.holds_loss = (n_stages - 1) in self.indices
        """This rank runs the last stage: the losses and items are counted here."""
        self.tied = tied or {}
        """A tied weight's copies on this rank by their names, under the first stage's name:
        their gradients are summed over the group."""
        self.tied_shapes = tied_shapes or {}
        """Each tied weight's gradient as this rank would hold it: a rank without a copy joins
        the sum with zeros."""
        self._built = None
        self._window: tuple[int, float] = (0, 0.0)
        """The last window's sends and idle seconds."""
        self._counted: list[int] = []
        self._loss_fn: LossFn | None = None
        self._batches: list[Batch] = []

    def stats(self) -> PipelineStats:
        """This rank's last window: its sends, its idle time, the schedule's idle share."""
        v = len(self.indices)
        return PipelineStats(*self._window, idle_share(self.n_stages // v, v, self.micro_steps))

    def describe(self) -> str:
        """The stages and what each holds, for the run's record."""
        last = max(u for r in self.runs for u in r)

        def name(u: int) -> str:
            return "embeddings" if u == 0 else "head" if u == last else f"block {u - 1}"

        held = [name(r[0]) + (f"–{name(r[-1])}" if len(r) > 1 else "") for r in self.runs]
        return f"{self.n_stages} stages by {self.schedule}: " + " | ".join(held)

    def _schedule(self):
        """The one schedule (its stages' buffers are sized for one count of micro-batches:
        `micro_steps`, fixed by the first window where not given)."""
        if self._built is None:
            from torch.distributed import pipelining as pp

            kinds = {"gpipe": pp.ScheduleGPipe, "1f1b": pp.Schedule1F1B,
                     "interleaved_1f1b": pp.ScheduleInterleaved1F1B,
                     "zbv": pp.ScheduleZBVZeroBubble}  # fmt: skip
            kind = kinds[self.schedule]
            if self.schedule == "1f1b" and self.micro_steps < self.n_stages:
                kind = pp.ScheduleGPipe  # the same gradients; 1F1B needs m ≥ P
            given = self.stages if self.schedule in _LOOPED else self.stages[0]
            self._built = kind(given, self.micro_steps, loss_fn=self._loss, scale_grads=False)
        return self._built

    def _loss(self, output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        # the schedule hands a loss a tensor: the micro-batch's index stands for its batch
        assert self._loss_fn is not None
        i = int(index)
        if i >= len(self._batches):
            # a filler of a short window holds no rows: the loss never sees it (an objective
            # that counts rows or pairs would count its padding), its gradient is zero
            self._counted.append(0)
            return output.float().sum() * 0.0
        # the loss sees the micro-batch as it was given: the padding's rows and positions cut
        # off the output (causal rows: a real position never saw the padding after it)
        batch = self._batches[i]
        rows, width = batch["input"].shape
        total, counted = summed(self._loss_fn(_Output(output[:rows, :width]), batch))
        self._counted.append(counted)
        return total

    def run(
        self, micro_batches: Sequence[Batch], loss_fn: LossFn, train: bool = True
    ) -> tuple[list[float], int]:
        """Forward and backward of the window's micro-batches through the schedule (not
        `train`: the gradients dropped, for the losses alone); the last stage's item-loss sum
        per micro-batch and the items its loss function counted itself (empty and 0 on other
        ranks). A window of fewer micro-batches than the schedule's is filled with ones that
        hold no loss items (a short last window: its forwards cost, its gradients are the
        window's). The tied weights' gradients are summed after a backward."""
        self.micro_steps = self.micro_steps or scheduled_micro_steps(
            self.schedule, self.n_stages // len(self.indices), len(micro_batches)
        )
        if len(micro_batches) > self.micro_steps:
            raise ValueError(f"a window of {len(micro_batches)} micro-batches exceeds the "
                             f"pipeline schedule's {self.micro_steps}")  # fmt: skip
        padded = [self._padded(mb) for mb in micro_batches]
        padded += [self._empty(padded[0])] * (self.micro_steps - len(padded))
        self._loss_fn, self._counted, self._batches = loss_fn, [], list(micro_batches)
        losses: list[torch.Tensor] = []
        # equal micro-batches side by side: the schedule's split gives them back as they were
        first = 0 in self.indices
        inputs = (torch.cat([mb["input"] for mb in padded]),) if first else ()
        for stage in self.stages:
            stage.busy_s, stage.sends = 0.0, 0
        start = time.perf_counter()
        # forwards alone run the same schedule, its gradients dropped: torch 2.13's `eval`
        # does not run the looped schedules, and a switch re-sizes the stages' buffers
        with torch.enable_grad():
            self._schedule().step(
                *inputs,
                target=torch.arange(len(padded)) if self.holds_loss else None,
                losses=losses if self.holds_loss else None,
                return_outputs=False,
            )
        busy = sum(stage.busy_s for stage in self.stages)
        wall = time.perf_counter() - start
        self._window = (sum(stage.sends for stage in self.stages), max(0.0, wall - busy))
        # the stages' metadata inference (the schedule's first window) calls the loss too
        counted = sum(self._counted[-len(padded) :]) if self.holds_loss else 0
        if train:
            self._sum_tied()
        else:
            for module in self.modules:
                for param in module.parameters():
                    param.grad = None
        return [float(x.detach()) for x in losses[: len(micro_batches)]], counted

    def _empty(self, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"input": torch.zeros_like(like["input"]),
                "target": torch.full_like(like["target"], IGNORE_INDEX)}  # fmt: skip

    def _padded(self, batch: Batch) -> dict[str, torch.Tensor]:
        if "documents" in batch or "input" not in batch:
            raise ValueError("a pipeline takes token rows (`input`, `target`), not packed ones")
        rows, width = batch["input"].shape
        self.rows = self.rows or rows
        if rows > self.rows or width > self.width:
            raise ValueError(
                f"a micro-batch of {rows} × {width} tokens exceeds the pipeline's "
                f"{self.rows} × {self.width} (its micro-batch × the model's sequence)"
            )
        out = {}
        for key, fill in (("input", 0), ("target", IGNORE_INDEX)):
            t = batch[key]
            full = torch.full((self.rows, self.width), fill, dtype=t.dtype, device=t.device)
            full[:rows, :width] = t
            out[key] = full
        return out

    @torch.no_grad()
    def _sum_tied(self) -> None:
        for name, (shape, dtype) in self.tied_shapes.items():
            copies = list(self.tied.get(name, {}).values())
            grads = [_local(p.grad) for p in copies if p.grad is not None]
            if len(grads) != len(copies):
                raise RuntimeError(f"a copy of the tied {name} has no gradient after the window")
            if grads:
                total = torch.stack(grads).sum(0)
            else:
                total = torch.zeros(shape, dtype=dtype, device=self.stages[0].device)
            total = all_reduce(total, group=self.group)
            for g in grads:
                g.copy_(total)

    def tied_once(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """`grads` without the tied weights' copies after the first stage's: the norm counts
        each weight once."""
        later = {id(p.grad) for first, copies in self.tied.items()
                 for name, p in copies.items() if name != first}  # fmt: skip
        return [g for g in grads if id(g) not in later]

    def grad_norm(self, norm_here: torch.Tensor) -> torch.Tensor:
        """The norm over every stage from this rank's stages' (all-reduced over the group)."""
        square = (norm_here.detach().double() ** 2).reshape(1)
        return all_reduce(square, group=self.group).sqrt()[0].float()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def cut_stages(
    build: Callable[[], nn.Module],
    weights_of: Callable[[nn.Module], list[int]],
    n_stages: int,
    indices: Sequence[int],
) -> tuple[nn.Module, list[nn.Module], list[range]]:
    """(this rank's part of the model, its stage modules, every stage's units): the model
    built once and cut to the units of this rank's stages; each stage a module of its own
    that shares the part's submodules (names stay the whole model's)."""
    model = build()
    runs = balanced_runs(weights_of(model), n_stages)
    mine = sorted(u for i in indices for u in runs[i])
    part = model.keep_pipeline_units(mine) if len(indices) > 1 else None
    if part is None:
        stage = model.keep_pipeline_units(list(runs[indices[0]]))
        return stage, [stage], runs
    stages = []
    for i in indices:
        # a view of its own down to the modules a cut changes (the model's `pipeline_view`
        # where they lie deeper than its own children)
        view = getattr(part, "pipeline_view", None)
        stage = view() if view is not None else shallow_copy(part)
        stages.append(stage.keep_pipeline_units(list(runs[i])))
    return part, stages, runs


def shallow_copy(module: nn.Module) -> nn.Module:
    """`module` as a module of its own that shares its children, parameters and buffers: a
    child set or removed on the copy leaves the original as it was."""
    out = copy.copy(module)
    out.__dict__ = dict(module.__dict__)
    for attr in ("_modules", "_parameters", "_buffers"):
        setattr(out, attr, dict(getattr(module, attr)))
    return out


def build_pipeline(
    recipe,
    device: torch.device,
    nodes: Sequence[str],
    pp: int,
    schedule: str,
    per_rank: int,
    shard: Callable[..., None],
    shape: tuple[int, int] | None = None,
    tp: int = 1,
    replicate: int = 1,
) -> tuple[nn.Module, Pipeline, Any]:
    """This rank's part of `recipe`'s model (its stages, each split over the tensor-parallel
    ranks by the model's plan where `tp` > 1, then sharded by `shard(stage, mesh, placement)`
    over the data-parallel ranks of its stage — mesh None: a rank per stage, none to shard),
    the pipeline that runs them and the (`pp`, `dp`[, `tp`]) mesh: stages outermost (a
    stage's p2p sends may cross nodes), each stage's data-parallel and tensor-parallel groups
    inside a node where the placement allows; `replicate` > 1: each stage's data-parallel
    ranks in HSDP's replica groups (`replicate`, `shard` in place of `dp`)."""
    from rayacc.engine.parallel.fsdp_mesh import materialize_shards, node_mesh

    world = len(nodes)
    if world % (pp * tp):
        raise ValueError(f"pipeline_parallel={pp} × tensor_parallel={tp} does not divide the "
                         f"group's {world} ranks")  # fmt: skip
    if schedule == "zbv" and world > pp:
        raise ValueError(ZBV_SHARDED)
    dp = world // (pp * tp)
    if dp % replicate:
        raise ValueError(f"fsdp.replicate={replicate} does not divide a stage's {dp} ranks")
    data = (replicate, dp // replicate) if replicate > 1 else (dp,)
    data_names = ("replicate", "shard") if replicate > 1 else ("dp",)
    dims = (pp, *data, *((tp,) if tp > 1 else ()))
    names = ("pp", *data_names, *(("tp",) if tp > 1 else ()))
    grid = node_mesh(device.type, nodes, dims, names)
    shard_dim = data_names[-1]  # where a stage's rows of a parameter are cut
    n_stages = pp * per_rank
    indices = stage_indices(schedule, grid.get_local_rank("pp"), pp, per_rank)
    whole = recipe.build_on_meta or recipe.build
    probe = whole()
    if not callable(getattr(probe, "keep_pipeline_units", None)):
        raise ValueError(
            f"{type(probe).__name__} declares no pipeline split (`pipeline_units()` and "
            "`keep_pipeline_units(units)`): it cannot be cut into stages"
        )
    values = recipe.initial_values(probe) if recipe.initial_values and _on_meta(probe) else None
    tied_names = getattr(probe, "pipeline_tied", dict)()
    named = dict(probe.named_parameters())
    # a frozen tied weight (a LoRA base) keeps its start on every copy: nothing to sum
    full_shapes = {first: named[first].shape for first in tied_names.values()
                   if named[first].requires_grad}  # fmt: skip
    build = whole if values is not None else recipe.build
    part, stages, runs = cut_stages(build, lambda m: m.pipeline_units(), n_stages, indices)
    placement = None
    for stage in stages:
        if values is None:
            stage.to(device)
        if tp > 1:
            from rayacc.engine.parallel.tensor import apply_plan, fsdp_placement, tp_plan

            apply_plan(stage, grid["tp"], tp_plan(stage))
            placement = fsdp_placement
        # one rank per stage: nothing to shard (the stage is still prepared: recomputation,
        # compiled blocks)
        shard(stage, grid[data_names] if world > pp else None, placement)
    if values is not None:
        given = values

        def values(name: str, shape: torch.Size, _tied=tied_names) -> torch.Tensor:
            # a tied weight's later copy starts as the first one
            return given(_tied.get(name, name), shape)

        materialize_shards(part, device, values)
    tied: dict[str, dict[str, nn.Parameter]] = {}
    for later, first in tied_names.items():
        if first not in full_shapes:
            continue
        for name in (first, later):
            for stage in stages:
                p = dict(stage.named_parameters()).get(name)
                if p is not None and all(p is not q for q in tied.get(first, {}).values()):
                    tied.setdefault(first, {})[name] = p
    dp_rank, dp = grid.get_local_rank(shard_dim), grid[shard_dim].size()
    shapes = {}
    for first, full in full_shapes.items():
        rows = math.ceil(full[0] / dp)
        held = max(0, min(full[0], (dp_rank + 1) * rows) - dp_rank * rows)
        shapes[first] = (torch.Size([held, *full[1:]]), torch.float32)
    longest = getattr(probe, "block_size", None)
    if longest is None:
        raise ValueError("the model names no sequence length (`block_size`) for its stages")
    # the data's longest row, not the model's longest sequence (an `hf` model's
    # max_position_embeddings: padding every row to it would compute thousands of positions
    # for hundreds)
    width = min(int(longest), recipe.tokens or int(longest))
    pipeline = Pipeline(stages, indices, n_stages, schedule, grid["pp"].get_group(), device,
                        int(width), runs, tied, shapes, shape)  # fmt: skip
    return part, pipeline, grid


def _on_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())
