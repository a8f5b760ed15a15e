"""Rules across fields, one small function per section. Each runs on whichever sections are
valid by themselves, so one pass reports field errors and cross-field errors together."""

from __future__ import annotations

from typing import Any

from rayacc.config.batch_schedule import schedule_rules
from rayacc.config.batch_split import (
    BatchSplitError,
    resolve_batch_split,
    split_for_workers,
)
from rayacc.config.errors import MISSING, ConfigIssue
from rayacc.config.features import composition_issues
from rayacc.config.finetune import finetune_rules
from rayacc.config.mesh import Mesh
from rayacc.config.parallel import pipeline_rules, tensor_parallel_rules
from rayacc.config.strategies import strategies, strategy_sections

# the sections (config/schema.py) arrive as arguments: this module imports nothing of the schema,
# which calls it, so the two never import each other
ModelConfig = DataConfig = BatchConfig = ScalingConfig = TrainSection = Any

__all__ = ["cross_field_issues", "strategy_resets"]


def _model_rules(model: ModelConfig, data: DataConfig | None) -> list[ConfigIssue]:
    issues = []
    if model.name == "factory" and not model.factory:
        issues.append(
            ConfigIssue(
                "model.factory",
                "is empty while model.name is 'factory'",
                None,
                "set model.factory to 'package.module:function'",
            )
        )
    if model.factory and model.name != "factory":
        issues.append(
            ConfigIssue(
                "model.factory",
                f"is set but model.name is {model.name!r}, so it would be ignored",
                model.factory,
                "set model.name=factory, or remove model.factory",
            )
        )
    hf_set = model.hf.config is not None or model.hf.weights is not None
    if model.name == "hf" and not hf_set:
        issues.append(
            ConfigIssue(
                "model.hf.config",
                "is empty while model.name is 'hf' (and no model.hf.weights folder holds one)",
                None,
                "set model.hf.config to a local config.json or folder, or a mapping with "
                "model_type (e.g. {model_type: llama, ...}), or model.hf.weights to a folder",
            )
        )
    if hf_set and model.name != "hf":
        issues.append(
            ConfigIssue(
                "model.hf",
                f"is set but model.name is {model.name!r}, so it would be ignored",
                MISSING,
                "set model.name=hf, or remove model.hf",
            )
        )
    if isinstance(model.hf.config, dict) and "model_type" not in model.hf.config:
        issues.append(
            ConfigIssue(
                "model.hf.config",
                "a mapping without model_type (transformers builds a config by its type)",
                MISSING,
                "add model_type, e.g. model_type: llama",
            )
        )
    if model.factory and model.factory.count(":") != 1:
        issues.append(
            ConfigIssue(
                "model.factory",
                "is not of the form 'package.module:function'",
                model.factory,
                "write e.g. mypkg.models:build",
            )
        )
    if model.n_embd % model.n_head:
        issues.append(
            ConfigIssue(
                "model.n_head",
                f"does not divide model.n_embd={model.n_embd}",
                model.n_head,
                f"set model.n_embd to a multiple of {model.n_head}, or model.n_head to a "
                f"divisor of {model.n_embd}",
            )
        )
    if model.name == "gpt" and data is not None and data.seq_len > model.block_size:
        issues.append(
            ConfigIssue(
                "data.seq_len",
                f"is longer than model.block_size={model.block_size}",
                data.seq_len,
                f"set data.seq_len <= {model.block_size}, or raise model.block_size",
            )
        )
    return issues


def _scaling_rules(scaling: ScalingConfig) -> list[ConfigIssue]:
    lo, hi = scaling.min_workers, scaling.max_workers
    if lo < 1 or hi < lo:
        return [
            ConfigIssue(
                "scaling.num_workers",
                "must be a positive count or [min, max] with 1 <= min <= max",
                scaling.num_workers,
                "e.g. 2, or [1, 4] for an elastic run",
            )
        ]
    if scaling.elastic:
        return []
    # compared with the defaults, not "was it set": a dumped config sets every field
    ignored = sorted(
        name
        for name in ("on_resize", "resize_interval_s")
        if getattr(scaling, name) != type(scaling).model_fields[name].default
    )
    if not ignored:
        return []
    return [
        ConfigIssue(
            "scaling." + ignored[0],
            "only applies to elastic runs",
            MISSING,
            "give scaling.num_workers as [min, max], or remove it",
        )
    ]


def _auto_micro_batch_rules(batch: BatchConfig, scaling: ScalingConfig | None) -> list[ConfigIssue]:
    if not batch.auto_micro_batch:
        return []
    issues = []
    if batch.global_batch_size is None:
        issues.append(
            ConfigIssue(
                "batch.global_batch_size",
                "is required with batch.micro_batch_size=auto (the search keeps it fixed)",
                None,
                "set batch.global_batch_size",
            )
        )
    if batch.grad_accum_steps is not None:
        issues.append(
            ConfigIssue(
                "batch.grad_accum_steps",
                "is derived when batch.micro_batch_size=auto, so it cannot be set too",
                batch.grad_accum_steps,
                "remove batch.grad_accum_steps, or give a micro_batch_size",
            )
        )
    if scaling is not None and not scaling.use_gpu and batch.memory_budget_mb is None:
        issues.append(
            ConfigIssue(
                "batch.memory_budget_mb",
                "is required for batch.micro_batch_size=auto on CPU workers",
                None,
                "set batch.memory_budget_mb (MiB per worker), e.g. 2048",
            )
        )
    return issues


def _batch_plan_rules(batch: BatchConfig, scaling: ScalingConfig, mesh: Mesh) -> list[ConfigIssue]:
    try:
        base = resolve_batch_split(
            num_workers=scaling.max_workers,
            mesh=mesh,
            global_batch_size=batch.global_batch_size,
            micro_batch_size=batch.fixed_micro_batch_size,
            grad_accum_steps=batch.grad_accum_steps,
            uneven=scaling.keeps_global_batch,
        )
    except BatchSplitError as exc:
        return [ConfigIssue(exc.field, exc.problem, MISSING, exc.fix)]
    return _planned_micro_batch_rules(batch, scaling, base)


def _planned_micro_batch_rules(
    batch: BatchConfig, scaling: ScalingConfig, base
) -> list[ConfigIssue]:
    """Each entry of `batch.micro_batch_by_workers` is a worker count the elastic run can have
    and a micro-batch that divides the worker's share there (a run that reached such a size
    would stop; one whose largest size is such would not start)."""
    planned = batch.micro_batch_by_workers
    if not planned or not scaling.elastic or scaling.on_resize != "keep_global_batch":
        return []  # ignored, with a warning before launch
    lo, hi = scaling.min_workers, scaling.max_workers
    issues = []
    outside = sorted(w for w in planned if not lo <= w <= hi)
    if outside:
        issues.append(
            ConfigIssue(
                "batch.micro_batch_by_workers",
                f"names worker count(s) {outside} outside scaling.num_workers [{lo}, {hi}]",
                planned,
                "remove those entries, or widen scaling.num_workers",
            )
        )
    for workers in sorted(w for w in planned if lo <= w <= hi):
        try:
            split_for_workers(base, workers, scaling.on_resize, planned)
        except BatchSplitError as exc:
            if exc.field == "batch.micro_batch_by_workers":
                issues.append(ConfigIssue(exc.field, exc.problem, planned, exc.fix))
    return issues


def _foreign_settings(sections: dict[str, Any], strategy: str) -> list[tuple[str, Any, Any]]:
    """(dotted key, value, default) of every field of another strategy's section that is not
    its default: today's fields and tomorrow's, read from the schema."""
    found = []
    for name, owner in strategy_sections().items():
        section = sections.get(name)
        if section is None or owner == strategy:
            continue
        for field, info in type(section).model_fields.items():
            value, default = getattr(section, field), info.get_default(call_default_factory=True)
            if value != default:
                found.append((f"{name}.{field}", value, default))
    return found


def _other_strategys_settings(train: TrainSection, sections: dict[str, Any]) -> list[ConfigIssue]:
    """Another strategy's setting is refused rather than ignored: `deepspeed.stage=3` alone
    would train under DDP."""
    owners = strategy_sections()
    return [
        ConfigIssue(
            key,
            f"applies to train.strategy={owners[key.split('.')[0]]}, and the strategy is "
            f"{train.strategy!r}",
            value,
            f"set train.strategy={owners[key.split('.')[0]]}, or remove {key}",
        )
        for key, value, _ in _foreign_settings(sections, train.strategy)
    ]


def strategy_resets(cfg, strategy: str) -> dict[str, Any]:
    """The dotted keys that put `cfg`'s settings of strategies other than `strategy` back to
    their defaults: what a derived config that switches the strategy (a planner candidate, a
    sweep trial, a plan applied to a job) sets with it, so the job's settings for its own
    strategy do not stand in the other's way."""
    sections = {name: getattr(cfg, name) for name in strategy_sections()}
    return {key: default for key, _, default in _foreign_settings(sections, strategy)}


def cross_field_issues(sections: dict[str, Any]) -> list[ConfigIssue]:
    """Every rule whose sections are valid, in a fixed order."""
    model, data = sections.get("model"), sections.get("data")
    batch, scaling = sections.get("batch"), sections.get("scaling")
    issues: list[ConfigIssue] = []
    if model is not None:
        issues += _model_rules(model, data)
    issues += composition_issues(sections)
    issues += finetune_rules(sections)
    issues += schedule_rules(sections)
    if scaling is not None:
        scaling_issues = _scaling_rules(scaling)
        issues += scaling_issues
        if any(i.path == "scaling.num_workers" for i in scaling_issues):
            # a worker count that makes no sense would only add noise below
            scaling = None
    train = sections.get("train")
    if train is not None:
        issues += _other_strategys_settings(train, sections)
        issues += tensor_parallel_rules(train, sections, scaling)
        issues += pipeline_rules(train, sections, scaling)
        rules = strategies()[train.strategy].rules
        issues += rules(sections, scaling) if rules is not None else []
    if batch is not None:
        issues += _auto_micro_batch_rules(batch, scaling)
        if scaling is not None:
            issues += _batch_plan_rules(batch, scaling, Mesh.of_sections(train))
    return issues
