"""The one registry of parallel strategies: each name `train.strategy` takes, the engine's wing
that carries it out (`engine/parallel/<name>.py`, named here by its import path so the config
layer never imports torch), the config section it owns and its cross-field rules. The schema's
strategy names, the rules, the MLflow params, the planner and the console read it; a strategy
of another package registers under the entry-point group `rayacc.strategies`
(`name = "package.module:Class"`), as pytest's and MLflow's plugins do."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from rayacc.config.errors import ConfigIssue
from rayacc.config.mesh import Mesh

ADAM_FAMILY = ("adamw", "adam")
"""The optimizers (`optim.name`) whose state is Adam's moments (`exp_avg`, `exp_avg_sq`): what
DeepSpeed's universal checkpoint carries."""

__all__ = [
    "DEFAULT_STRATEGY",
    "ENTRY_POINT_GROUP",
    "StrategyEntry",
    "strategies",
    "strategy_entry",
    "strategy_sections",
]

ENTRY_POINT_GROUP = "rayacc.strategies"

Rules = Callable[[Mapping[str, Any], Any], list[ConfigIssue]]
"""(the valid sections by name, the scaling section or None) → the strategy's own issues; run
only when `train.strategy` names it."""


@dataclass(frozen=True)
class StrategyEntry:
    name: str
    wing: str
    """`module:Class` of its `Strategy` (imported by the engine only)."""
    section: str | None = None
    """The config section only it reads (refused, not ignored, under another strategy)."""
    rules: Rules | None = None
    without_tensor_parallel: str | None = "it declares no tensor parallelism"
    """Why it does not compose with tensor parallelism (`Mesh.tensor` > 1); None: it does."""
    without_pipeline_parallel: str | None = "it declares no pipeline parallelism"
    """Why it does not compose with pipeline parallelism (`Mesh.pipeline` > 1); None: it does."""
    fixed_accumulation: str | None = None
    """Why its accumulation cannot change within a worker group (`batch.schedule`); None: it
    can."""
    counts_first: str | None = None
    """Why it needs a window's count before its first backward (a weighted objective's count
    comes with the forward); None: it takes the count after."""
    refuses: Mapping[str, str] = field(default_factory=dict)
    """The other features (config/features.py) it does not compose with, and why."""


# ----------------------------------------------------------------------------- built-in rules
def _fsdp_rules(sections: Mapping[str, Any], scaling: Any) -> list[ConfigIssue]:
    train, fsdp = sections["train"], sections.get("fsdp")
    mesh = Mesh.of_sections(train, fsdp)
    return _fsdp_mesh_rules(mesh, scaling) if fsdp is not None else []


def _fsdp_mesh_rules(mesh: Mesh, scaling: Any) -> list[ConfigIssue]:
    """HSDP's replica groups: a number that divides every worker count the run may have (its
    data-parallel ranks, under tensor or pipeline parallelism)."""
    r, tp = mesh.replicate, mesh.model_parallel
    if r == "auto" or r == 1 or scaling is None:
        return []
    if scaling.elastic:
        return [
            ConfigIssue(
                "fsdp.replicate",
                "a number of replica groups cannot follow an elastic group's size",
                r,
                "set fsdp.replicate=auto (one per node, re-derived at every size), or give one "
                "worker count",
            )
        ]
    if (scaling.min_workers // tp) % r:
        ranks = f"scaling.num_workers={scaling.min_workers}"
        if tp > 1:
            degrees = " × ".join(mesh.setting(d) for d in ("tensor", "pipeline")
                                 if getattr(mesh, d) > 1)  # fmt: skip
            ranks = (f"the data-parallel ranks ({ranks} / {degrees} = "
                     f"{scaling.min_workers // tp})")  # fmt: skip
        return [
            ConfigIssue(
                "fsdp.replicate",
                f"does not divide {ranks}",
                r,
                "give a divisor of the worker count, or fsdp.replicate=auto",
            )
        ]
    return []


def _deepspeed_rules(sections: Mapping[str, Any], scaling: Any) -> list[ConfigIssue]:
    """What DeepSpeed under rayacc does not run yet, and its section's own rule."""
    train, ds = sections["train"], sections.get("deepspeed")
    issues = []
    if ds is not None and ds.offload_params != "none" and ds.stage != 3:
        issues.append(
            ConfigIssue(
                "deepspeed.offload_params",
                "parameters are offloaded only under ZeRO stage 3",
                ds.offload_params,
                "set deepspeed.stage=3, or deepspeed.offload_params=none",
            )
        )
    fix = "use train.strategy=ddp or fsdp for it"
    if train.precision == "fp16" and scaling is not None and not scaling.use_gpu:
        issues.append(
            ConfigIssue(
                "train.precision",
                "DeepSpeed's fp16 (its loss scaler and fp16 kernels) needs a GPU: its CPU "
                "accelerator has none",
                train.precision,
                "set train.precision=bf16 (or fp32) for CPU workers, or scaling.use_gpu=true",
            )
        )
    optim = sections.get("optim")
    if (
        scaling is not None
        and scaling.elastic
        and optim is not None
        and optim.name not in ADAM_FAMILY
    ):
        # each resize restarts from DeepSpeed's universal checkpoint, whose converter and
        # ZeRO-3 loader read Adam's state (`exp_avg`, `exp_avg_sq`) and fail on any other
        issues.append(
            ConfigIssue(
                "scaling.num_workers",
                "an elastic group under DeepSpeed resizes through DeepSpeed's universal "
                f"checkpoint, which carries Adam's state only, and optim.name is {optim.name!r}",
                list(scaling.num_workers),
                "set optim.name=adamw (or adam), or give one worker count with "
                f"train.strategy=deepspeed, or {fix}",
            )
        )
    return issues


# ----------------------------------------------------------------------------- the registry
DEFAULT_STRATEGY = "ddp"

_BUILT_IN = (
    StrategyEntry(
        DEFAULT_STRATEGY,
        "rayacc.engine.parallel.ddp:DDP",
        # the field's practice: torchtitan refuses DDP with a second dimension too
        without_tensor_parallel="DistributedDataParallel takes no DTensor parameters; with "
        "tensor parallelism the data-parallel ranks replicate through FSDP2's replicate "
        "dimension (train.strategy=fsdp with fsdp.replicate = the data-parallel ranks: every "
        "rank holds its whole tensor-parallel share and the gradients are all-reduced once a "
        "window, as under DDP)",
        without_pipeline_parallel="its reducer expects one backward per forward of its own "
        "module, which a schedule's split backwards break; a pipeline's stages shard over the "
        "data-parallel ranks with train.strategy=fsdp",
    ),
    StrategyEntry(
        "fsdp",
        "rayacc.engine.parallel.fsdp:FSDP",
        "fsdp",
        _fsdp_rules,
        without_tensor_parallel=None,
        without_pipeline_parallel=None,
        refuses={
            "fp16": "fp16 needs a gradient scaler for sharded gradients, which rayacc does not have"
        },
    ),
    StrategyEntry(
        "deepspeed",
        "rayacc.engine.parallel.deepspeed:DeepSpeed",
        "deepspeed",
        _deepspeed_rules,
        without_tensor_parallel="DeepSpeed's ZeRO partitions the flattened parameters itself, "
        "which a tensor-parallel split of each layer cannot share",
        without_pipeline_parallel="DeepSpeed has a pipeline engine of its own (PipelineModule) "
        "that rayacc does not drive; use train.strategy=fsdp",
        fixed_accumulation="its engine's gradient_accumulation_steps is fixed when it is built",
        counts_first="DeepSpeed's engine scales each backward itself",
        refuses={
            "compile": "torch.compile under DeepSpeed's engine is not supported",
            "auto_micro": "DeepSpeed's engine is built for one micro-batch: `auto` cannot search",
        },
    ),
)


@functools.cache
def strategies() -> Mapping[str, StrategyEntry]:
    """Every strategy by name: the built-in ones, then those other packages register (their
    entry points are read, not loaded: a plugin's module is imported by the engine when a run
    uses it). A plugin cannot take a built-in's name (it is warned of and left out)."""
    found = {e.name: e for e in _BUILT_IN}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in found:
            warnings.warn(
                f"entry point {ep.value!r} ({ENTRY_POINT_GROUP}) takes the name of the "
                f"strategy {ep.name!r} and is left out: give it a name of its own",
                stacklevel=2,
            )
            continue
        found[ep.name] = StrategyEntry(ep.name, ep.value)
    return found


def strategy_entry(name: str) -> StrategyEntry:
    known = strategies()
    if name not in known:
        raise ValueError(f"train.strategy {name!r} is not one of {', '.join(known)}")
    return known[name]


def strategy_sections() -> dict[str, str]:
    """Section name → the strategy that owns it."""
    return {e.section: e.name for e in strategies().values() if e.section}
