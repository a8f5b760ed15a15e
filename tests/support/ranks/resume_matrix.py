"""The resume matrix: strategy × layout × optimizer × change, each case on gloo ranks through
the product's build path (`build_rank`) and the product's checkpoint parts (the strategy's
state format, the random streams, `WorkerParts.load`). Phase 1 trains two windows on the
first layout, writes a checkpoint as a rank does (every part), and trains two more: the
uninterrupted run. Phase 2 builds the second layout fresh, loads that checkpoint and trains
the same two windows: the resumed run. Cases are grouped by the ranks of each phase, so the
matrix costs one spawn of rank processes per group (at most five).

Dropout is on where the data-parallel ranks stay (`same`): each rank's stream is restored, so
the resumed run draws the uninterrupted run's masks and is bit for bit the same. Where the
data-parallel ranks change, the streams are seeded anew (the rows each rank reads changed
too), so those cases compare without dropout, and a tensor-parallel case with dropout checks
instead that every rank of a tensor-parallel group still draws alike (its replicated
parameters stay equal)."""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.support.ranks import matrix as M

GLOBAL, MICRO = 16, 2
"""Rows per window (over 1, 2 or 4 data-parallel ranks) and rows per micro-batch."""
LRS = {"sgd": 0.5, "adamw fused": 0.02, "adamw": 0.02, "adam": 0.02}
DROPOUT = 0.2

LAYOUTS = (
    "ddp",
    "fsdp every_micro_step",
    "fsdp window_end",
    "hsdp",
    "fsdp × tp",
    "hsdp × tp",
    "fsdp × pp",
    "zero1",
    "zero2",
    "zero3",
    "zero2 offload",
    "zero3 offload",
)
OPTIMIZERS = ("sgd", "adamw fused", "adamw", "adam")
CHANGES = ("same", "shrink", "grow", "tp")


@dataclass(frozen=True)
class Mesh:
    """A phase's layout: the workers, the tensor-parallel group size, HSDP's replica groups."""

    workers: int
    tp: int = 1
    replicate: int = 1
    pp: int = 1
    """Pipeline stages (1F1B)."""

    @property
    def dp(self) -> int:
        return self.workers // self.tp // self.pp


def meshes(layout: str, change: str) -> tuple[Mesh, Mesh] | None:
    """(first, resumed) layouts of a case, or None where the change means nothing there."""
    if layout.startswith("zero"):
        # DeepSpeed runs at 2 ranks at least; another size goes through its universal checkpoint
        return {"same": (Mesh(2), Mesh(2)), "grow": (Mesh(2), Mesh(4))}.get(change)
    if layout == "hsdp":
        return {
            "same": (Mesh(4, 1, 2), Mesh(4, 1, 2)),
            "shrink": (Mesh(4, 1, 2), Mesh(2, 1, 2)),
            "grow": (Mesh(2, 1, 2), Mesh(4, 1, 2)),
            "tp": (Mesh(2, 1, 2), Mesh(4, 2, 2)),
        }[change]
    if layout == "fsdp × tp":
        return {
            "same": (Mesh(4, 2), Mesh(4, 2)),
            "shrink": (Mesh(4, 2), Mesh(2, 2)),
            "grow": (Mesh(2, 2), Mesh(4, 2)),
            "tp": (Mesh(4, 2), Mesh(2, 1)),
        }[change]
    if layout == "fsdp × pp":
        return {
            "same": (Mesh(2, pp=2), Mesh(2, pp=2)),
            "shrink": (Mesh(4, pp=2), Mesh(2, pp=2)),
            "grow": (Mesh(2, pp=2), Mesh(4, pp=2)),
            "tp": (Mesh(2, pp=2), Mesh(4, 2, pp=2)),
        }[change]
    if layout == "hsdp × tp":
        return {
            "same": (Mesh(4, 2, 2), Mesh(4, 2, 2)),
            "shrink": (Mesh(4, 2, 2), Mesh(2, 2)),
            "tp": (Mesh(4, 2, 2), Mesh(2, 1, 2)),
        }.get(change)
    if change == "tp":
        return (Mesh(2), Mesh(4, 2)) if layout.startswith("fsdp") else None
    return {"same": (Mesh(2), Mesh(2)), "shrink": (Mesh(2), Mesh(1)), "grow": (Mesh(2), Mesh(4))}[
        change
    ]


def valid(layout: str, optimizer: str, change: str) -> bool:
    if meshes(layout, change) is None:
        return False
    # DeepSpeed's universal checkpoint carries Adam's moments only (refused by name otherwise)
    return not (layout.startswith("zero") and change != "same" and optimizer == "sgd")


@dataclass(frozen=True)
class ResumeCase:
    index: int
    layout: str
    optimizer: str
    change: str
    dropout: bool = False
    """On for `same` (the streams restored: bit for bit) and for the tensor-parallel shrink
    case (the group's streams stay alike: checked by its replicated parameters)."""

    @property
    def first(self) -> Mesh:
        return meshes(self.layout, self.change)[0]

    @property
    def then(self) -> Mesh:
        return meshes(self.layout, self.change)[1]

    @property
    def compared(self) -> bool:
        """Whether the resumed run is compared with the uninterrupted one: not where dropout
        draws anew after the data-parallel ranks changed, nor after the tensor-parallel
        degree did (a split layer draws its mask over its shard: another shape, other
        masks)."""
        same = self.first.dp == self.then.dp and self.first.tp == self.then.tp
        return not self.dropout or same

    @property
    def bitwise(self) -> bool:
        """The same layout on the same ranks: the resumed run does exactly the same work."""
        return self.change == "same" and not self.layout.startswith("zero")

    def label(self) -> str:
        f, t = self.first, self.then
        mesh = f"{f.workers}→{t.workers} workers, tp {f.tp}→{t.tp}"
        if f.pp > 1 or t.pp > 1:
            mesh += f", pp {f.pp}→{t.pp}"
        mesh += f", replicate {f.replicate}→{t.replicate}"
        dropout = " | dropout" if self.dropout else ""
        return f"{self.layout} | {self.optimizer} | {self.change} ({mesh}){dropout}"


def cases() -> list[ResumeCase]:
    """Every pair of (layout, optimizer), (layout, change) and (optimizer, change) values that
    can run, each at least once (a greedy covering), with dropout on where it is checked; and
    two cases of three changes at once."""
    space = [
        dict(layout=layout, optimizer=o, change=c)
        for layout, o, c in itertools.product(LAYOUTS, OPTIMIZERS, CHANGES)
        if valid(layout, o, c)
    ]
    names = ("layout", "optimizer", "change")
    uncovered = {((a, x[a]), (b, x[b])) for x in space for a, b in itertools.combinations(names, 2)}
    chosen: list[dict] = []
    while uncovered:
        best = max(
            space,
            key=lambda x: sum(
                ((a, x[a]), (b, x[b])) in uncovered for a, b in itertools.combinations(names, 2)
            ),
        )
        chosen.append(best)
        for a, b in itertools.combinations(names, 2):
            uncovered.discard(((a, best[a]), (b, best[b])))
    # three at once, with dropout (fused AdamW, a changed mesh): the tensor-parallel shrink,
    # and a pipeline whose stages gain a tensor-parallel split — each checked where dropout
    # lets it be (a group's ranks still draw alike: its replicated parameters stay equal)
    extra = [dict(layout="fsdp × tp", optimizer="adamw fused", change="shrink"),
             dict(layout="fsdp × pp", optimizer="adamw fused", change="tp")]  # fmt: skip
    return [ResumeCase(i, dropout=c["change"] == "same", **c) for i, c in enumerate(chosen)] + [
        ResumeCase(len(chosen) + i, dropout=True, **c) for i, c in enumerate(extra)
    ]


def config(case: ResumeCase, mesh: Mesh):
    from rayacc.config import TrainConfig

    layout = case.layout
    strategy = "ddp"
    sections: dict = {}
    if layout.startswith(("fsdp", "hsdp")):
        strategy = "fsdp"
        grad_sync = layout.split(" ")[1] if "_" in layout else "every_micro_step"
        sections["fsdp"] = {"grad_sync": grad_sync, "replicate": mesh.replicate}
    elif layout.startswith("zero"):
        strategy = "deepspeed"
        stage = int(layout[4])
        off = "cpu" if "offload" in layout else "none"
        sections["deepspeed"] = {"stage": stage, "offload_optimizer": off}
    name, _, fused = case.optimizer.partition(" ")
    optim = {"name": name, "lr": LRS[case.optimizer], "weight_decay": 0.01}
    if name == "sgd":
        optim |= {"momentum": 0.9, "weight_decay": 0.0}
    optim["fused"] = bool(fused) if name != "sgd" else None
    return TrainConfig.model_validate(
        {
            "seed": 5,
            "model": {
                "name": "gpt",
                "n_layer": 2,
                "n_head": 2,
                "n_embd": 16,
                "block_size": M.BLOCK,
                "dropout": DROPOUT if case.dropout else 0.0,
            },
            "batch": {"global_batch_size": GLOBAL, "micro_batch_size": MICRO},
            "scaling": {"num_workers": mesh.workers, "cpus_per_worker": 0.5},
            "optim": optim,
            "train": {
                "strategy": strategy,
                "tensor_parallel": mesh.tp,
                "pipeline_parallel": mesh.pp,
            },
            **sections,
        }
    )


def windows() -> list[list[torch.Tensor]]:
    """Four windows of variable-length sequences, the last one short (9 rows)."""
    from tests.support.ranks.engine_helpers import token_sequences

    sizes = [GLOBAL, GLOBAL, GLOBAL, 9]
    seqs = [
        s.clamp(max=M.VOCAB - 1)
        for s in token_sequences(sum(sizes), seed=47, min_len=2, max_len=M.BLOCK + 1)
    ]
    out, at = [], 0
    for n in sizes:
        out.append(seqs[at : at + n])
        at += n
    return out


def run_phase(case: ResumeCase, rank: int, world: int, folder: Path, phase: str) -> dict | None:
    """Phase 1: the uninterrupted run (a checkpoint written after its second window); phase 2:
    the resumed run from that checkpoint. Rank 0 returns the whole weights and optimizer
    state; every rank its replicated parameters' local values (a tensor-parallel group's
    agreement)."""
    import torch.distributed as dist

    from rayacc.engine import all_gather_objects
    from rayacc.engine.random_state import RandomStreams
    from rayacc.rank.build import build_rank
    from rayacc.worker.checkpoint import WorkerParts

    mesh = case.first if phase == "1" else case.then
    assert mesh.workers == world
    cfg, info = config(case, mesh), M.dataset()
    device = torch.device("cpu")
    parts = build_rank(cfg, info, device, LRS[case.optimizer], split=cfg.batch_split(world))
    strategy = parts.strategy
    group = strategy.data_group
    data_rank = dist.get_rank(group) if group is not None else rank
    dp = dist.get_world_size(group) if group is not None else world
    assert dp == mesh.dp, (dp, mesh)
    counts = strategy.process_group  # the streams: a pipeline's stages each their own
    stream = dist.get_rank(counts) if counts is not None else rank
    streams = RandomStreams(cfg.seed, stream, dist.get_world_size(counts) if counts else world,
                            device)  # fmt: skip
    streams.start()
    kept = WorkerParts(
        strategy, parts.optimizer, {}, rank=rank, world=world, device=device, streams=streams
    )
    all_windows = windows()

    def train(todo):
        for window in todo:
            mine = M.rank_share(window, data_rank, dp)
            batches = M.micro_batches(mine, MICRO, dp, len(window))
            parts.accumulate(batches, parts.loss_fn, parts.count)

    if phase == "1":
        train(all_windows[:2])
        whole, _ = strategy.state.save(strategy.model, parts.optimizer, folder, rank)
        rng = all_gather_objects(streams.state())
        if rank == 0:
            torch.save({**whole, "rng": rng}, folder / "state.pt")
        dist.barrier()
        train(all_windows[2:])
    else:
        saved = torch.load(folder / "state.pt", weights_only=True) if rank == 0 else {}
        box = [saved]
        dist.broadcast_object_list(box, src=0)
        meta = {"num_workers": case.first.workers, "optimizer_step": 2}
        kept.check(box[0], meta)
        kept.load(folder, box[0], meta)
        train(all_windows[2:])
    # a pipeline's ranks hold their stages: every rank's parts, merged
    weights = _merged(_weights(strategy))
    state = _optimizer_state(strategy, parts.optimizer)
    state = _merged(state) if state is not None else None
    replicated = _replicated_locals(strategy.unwrapped())
    if rank != 0:
        return {"replicated": replicated}
    return {"weights": weights, "optimizer": state, "replicated": replicated}


def _merged(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's `parts` in one (a collective)."""
    from rayacc.engine import all_gather_objects

    out: dict[str, torch.Tensor] = {}
    for got in all_gather_objects(parts):
        out.update(got)
    return out


def _weights(strategy) -> dict[str, torch.Tensor]:
    """Every parameter whole, by name (a collective: every rank gathers)."""
    from torch.distributed.tensor import DTensor

    module = strategy.unwrapped()
    if strategy.name == "deepspeed":
        import deepspeed

        params = dict(module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().double().reshape(-1).clone() for n, p in params.items()}
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().double().reshape(-1)
        for n, p in module.named_parameters()
    }


def _optimizer_state(strategy, optimizer) -> dict[str, torch.Tensor] | None:
    """Every parameter's optimizer state, whole, by parameter name and slot (a collective);
    None under DeepSpeed, whose partitions its own files keep (its weights after the resumed
    steps carry the state's effect)."""
    if strategy.name == "deepspeed":
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    _, optim_state = get_state_dict(
        strategy.model, optimizer, options=StateDictOptions(full_state_dict=True)
    )
    out = {}
    for name, slots in optim_state["state"].items():
        for slot, value in slots.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                out[f"{name}.{slot}"] = value.detach().double().reshape(-1).clone()
    return out


def _replicated_locals(module) -> dict[str, torch.Tensor]:
    """The local values of the parameters replicated over the tensor-parallel dimension."""
    from torch.distributed.tensor import DTensor, Replicate

    out = {}
    for name, p in module.named_parameters():
        if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()):
            at = p.device_mesh.mesh_dim_names.index("tp")
            if isinstance(p.placements[at], Replicate):
                out[name] = p.to_local().detach().double().reshape(-1).clone()
    return out


def phase_groups(all_cases: list[ResumeCase]) -> list[tuple[str, int, list[ResumeCase]]]:
    groups = []
    for phase in ("1", "2"):
        for world in (1, 2, 4):
            chosen = [
                c for c in all_cases if (c.first if phase == "1" else c.then).workers == world
            ]
            if chosen:
                groups.append((phase, world, chosen))
    return groups


def run_group(rank: int, world: int, init_file: str, out_dir: str, phase: str, chosen) -> None:
    """Rank body: every case of one (phase, ranks) group in one gloo group; each rank saves
    its own results (a tensor-parallel group's agreement reads every rank's)."""
    from tests.support.ranks.dist_workers import run_scenarios

    # DeepSpeed's engine reads the rank from the environment, as a launcher sets it
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))

    def scenario(case: ResumeCase):
        def run(rank: int, world: int, out: dict) -> None:
            folder = Path(out_dir).parent / f"case{case.index}"
            folder.mkdir(exist_ok=True)
            got = run_phase(case, rank, world, folder, phase)
            out[case.index] = got

        return run

    run_scenarios(rank, world, init_file, out_dir, [scenario(c) for c in chosen])
