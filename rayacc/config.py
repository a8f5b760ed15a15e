"""Typed run configuration: YAML file + ``key.path=value`` overrides → :class:`TrainConfig`.

Every problem in a config is collected and reported at once by :class:`ConfigError`, each line
naming the field path, the value given and how to fix it.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Annotated, Any, Literal, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rayacc.batch_plan import BatchPlan, BatchPlanError, resolve_batch_plan

__all__ = [
    "BatchConfig",
    "ConfigError",
    "ConfigIssue",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "RunConfig",
    "ScalingConfig",
    "TrackingConfig",
    "TrainConfig",
    "TrainSection",
]


class ConfigIssue:
    """One problem in a config: where, what was given, what is wrong and how to fix it."""

    def __init__(self, path: str, message: str, value: Any = None, fix: str | None = None):
        self.loc: tuple[str, ...] = ()
        self.path = path
        self.message = message
        self.value = value
        self.fix = fix

    def __str__(self) -> str:
        given = "" if self.value is _MISSING else f" (got {self.value!r})"
        fix = f" Fix: {self.fix}" if self.fix else ""
        return f"{self.path or '<root>'}: {self.message}{given}.{fix}"

    def __repr__(self) -> str:
        return f"ConfigIssue({self!s})"


_MISSING = object()


class ConfigError(ValueError):
    """All problems found in one config, reported together."""

    def __init__(self, issues: list[ConfigIssue], source: str | None = None):
        self.issues = issues
        self.source = source
        where = f" in {source}" if source else ""
        n = len(issues)
        lines = [f"invalid config{where} ({n} problem{'s' if n != 1 else ''}):"]
        lines += [f"  - {issue}" for issue in issues]
        super().__init__("\n".join(lines))

    @property
    def paths(self) -> list[str]:
        return [issue.path for issue in self.issues]


class _Section(BaseModel):
    # attribute docstrings become field descriptions, which error messages quote as the fix
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True
    )


class ModelConfig(_Section):
    name: Literal["mlp", "gpt", "factory"] = "mlp"
    """Model family: `mlp` (classification on feature vectors), `gpt` (causal LM on tokens), or
    `factory` to build the model with `model.factory`."""
    factory: str | None = None
    """User model factory as "package.module:function"; called with `model.kwargs` and the dataset
    info; used only when `model.name` is `factory`."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed to `model.factory`."""
    hidden_sizes: list[int] = Field(default_factory=lambda: [128, 128])
    """mlp: widths of the hidden layers."""
    n_layer: int = Field(4, ge=1)
    """gpt: transformer blocks."""
    n_head: int = Field(4, ge=1)
    """gpt: attention heads per block; must divide `model.n_embd`."""
    n_embd: int = Field(128, ge=1)
    """gpt: embedding width."""
    block_size: int = Field(128, ge=2)
    """gpt: longest sequence the model accepts (positions)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout probability (0 keeps accumulation exactly equivalent to the big batch)."""


class DataConfig(_Section):
    source: str = "digits"
    """A bundled dataset name (`digits`, `shakespeare`) or a Parquet file/folder path or URI
    (local, s3://, gs://)."""
    shuffle: bool = True
    """Shuffle the global sample order each epoch (seeded by `seed` and the epoch)."""
    val_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    """Share of rows held out for validation; 0 = no validation."""
    last_window: Literal["short", "drop"] = "short"
    """Rows that do not fill a last global batch: `short` trains on them as a smaller window
    (normalised by its real size), `drop` skips them."""
    seq_len: int = Field(128, ge=2)
    """Token datasets: tokens per sample (sequence) when a bundled corpus is cut into samples."""
    cache_dir: str | None = None
    """Where bundled datasets are prepared as Parquet (default: ~/.cache/rayacc)."""
    materialize: bool = True
    """Read the Parquet once on the driver into Ray's object store (spilled to disk when large),
    so each worker (re)start fetches its rows in a fraction of a second; false = every rank reads
    the files itself (slower start, nothing held in the object store)."""


class BatchConfig(_Section):
    global_batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer step over all workers: micro_batch_size × grad_accum_steps ×
    num_workers. The invariant kept when the number of workers changes."""
    micro_batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] | None = None
    """Samples per worker per forward/backward (micro-step), or `auto`: before training, the
    largest divisor of one worker's share of the global batch whose forward + backward fits the
    memory budget on every rank (accumulation follows, the global batch is kept exactly); on a
    GPU an out-of-memory error later halves it on all ranks and redoes the window."""
    grad_accum_steps: int | None = Field(None, ge=1)
    """Micro-steps per optimizer step on each worker; derived from the other two when omitted."""
    memory_budget: float = Field(0.9, gt=0.0, le=1.0)
    """`micro_batch_size: auto` on GPU: share of the device's memory a micro-step may use."""
    memory_budget_mb: float | None = Field(None, gt=0.0)
    """`micro_batch_size: auto`: memory a micro-step may use per worker, in MiB (required on
    CPU, where it is checked against parameters, gradients, optimizer state and activations;
    on GPU it replaces `batch.memory_budget`)."""

    @property
    def auto_micro_batch(self) -> bool:
        return self.micro_batch_size == "auto"

    @property
    def fixed_micro_batch_size(self) -> int | None:
        """The configured micro-batch, None when omitted or `auto`."""
        return None if self.micro_batch_size == "auto" else self.micro_batch_size


class OptimConfig(_Section):
    name: Literal["adamw", "sgd"] = "adamw"
    """Optimizer."""
    lr: float = Field(1e-3, gt=0.0)
    """Base learning rate, tuned at `optim.base_batch_size`."""
    base_batch_size: int | None = Field(None, ge=1)
    """Global batch at which `optim.lr` was tuned; the LR is rescaled from it by
    `optim.lr_scaling`. Omitted: the configured global batch (effective LR = lr)."""
    lr_scaling: Literal["linear", "sqrt", "none"] = "linear"
    """How the LR follows global_batch_size / base_batch_size: linear, sqrt or none."""
    momentum: float = Field(0.0, ge=0.0, lt=1.0)
    """SGD momentum."""
    weight_decay: float = Field(0.0, ge=0.0)
    """Decoupled weight decay (AdamW) or L2 penalty (SGD)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear LR warmup."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """LR after warmup: cosine decay to `optim.min_lr_ratio` × LR at the last step, or constant."""
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Final LR of the cosine schedule as a share of the effective LR."""
    max_grad_norm: float | None = Field(None, gt=0.0)
    """Clip the global gradient norm to this value after unscaling; null = no clipping."""
    fused: bool | None = None
    """The optimizer's fused kernel (AdamW and SGD: one kernel per parameter instead of several
    per step; on a small CPU model about 3× faster than the per-tensor loop); null = on, on
    CPU and GPU workers alike."""


class TrainSection(_Section):
    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps to run; null = run `train.epochs` epochs."""
    epochs: int = Field(1, ge=1)
    """Passes over the training rows (when `train.max_steps` is null, or as its upper bound)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute precision: fp32, bf16 autocast, or fp16 autocast with a gradient scaler."""
    val_every_steps: int | None = Field(None, ge=1)
    """Run validation every N optimizer steps (and always at the end); null = only at the end."""
    checkpoint_every_steps: int | None = Field(None, ge=1)
    """Checkpoint every N optimizer steps (and always at the end); null = only at the end."""
    compile: bool = False
    """torch.compile the model (before DDP wraps it). The first steps pay the compilation
    (tens of seconds for GPT-2 small); accumulation and no_sync work as without it."""
    allow_tf32: bool = False
    """GPU, fp32 precision: let matmuls and convolutions use TF32 tensor cores (about 10 bits
    of mantissa instead of 23: faster, not bit-equal to fp32)."""
    loss_chunk_tokens: int | None = Field(8192, ge=1)
    """Token models with an output head (`gpt`): compute the vocabulary projection and
    cross-entropy this many positions at a time, so fp32 logits of a whole micro-batch are never
    held; null = all at once."""
    peak_tflops: float | None = Field(None, gt=0.0)
    """Peak TFLOP/s of one worker's device for `perf/mfu`; null = a known GPU's dense bf16
    peak, none on CPU (then only `perf/tflops` is logged)."""


class ScalingConfig(_Section):
    num_workers: int | tuple[int, int] = 2
    """Data-parallel training workers (one DDP rank each), or [min, max] for an elastic run:
    Ray starts as many as fit and restarts the group at a new size when capacity changes."""
    on_resize: Literal["keep_global_batch", "keep_micro_batch"] = "keep_global_batch"
    """Elastic runs: `keep_global_batch` re-derives accumulation (and the micro-batch when it
    must) so the global batch and effective LR stay; `keep_micro_batch` keeps accumulation, so
    the global batch follows the workers and the LR follows `optim.lr_scaling`."""
    resize_interval_s: float = Field(60.0, gt=0)
    """Elastic runs: how often Ray checks whether more workers fit."""
    use_gpu: bool = False
    """One GPU per worker (NCCL); CPU workers use gloo."""
    cpus_per_worker: float = Field(1.0, gt=0.0)
    """Logical CPUs reserved per worker (fractions allowed)."""
    extra_resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each worker needs besides CPUs/GPUs, e.g. {worker_slot: 1} on nodes
    that offer one slot each. Elastic sizing counts resources, not the placement strategy, so
    this is how an elastic run is held to one worker per node."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How Ray places the workers on nodes: PACK fills few nodes, SPREAD spreads when it can,
    STRICT_SPREAD puts every worker on its own node."""

    @property
    def elastic(self) -> bool:
        return not isinstance(self.num_workers, int)

    @property
    def min_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[0]

    @property
    def max_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[1]


class TrackingConfig(_Section):
    enabled: bool = True
    """Record the run in MLflow."""
    tracking_uri: str | None = None
    """MLflow tracking URI; null = sqlite:///<cwd>/mlflow.db."""
    experiment: str = "rayacc"
    """MLflow experiment name."""
    run_name: str | None = None
    """MLflow run name; null = generated."""


class RunConfig(_Section):
    name: str | None = None
    """Name of the run's folder under `run.storage_path`; null = a fresh unique name."""
    storage_path: str | None = None
    """Where checkpoints and run state go (absolute path or URI; shared storage on a multi-node
    cluster); null = <cwd>/rayacc_runs."""
    max_failures: int = Field(0, ge=-1)
    """Worker-group restarts from the latest checkpoint after a failure; -1 = unlimited."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept on storage (the newest)."""


class TrainConfig(_Section):
    """The whole configuration of one training run."""

    seed: int = 0
    """Seeds the model initialisation and the data order."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainSection = Field(default_factory=TrainSection)
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(
        cls, data: dict[str, Any], overrides: list[str] | None = None, source: str | None = None
    ) -> TrainConfig:
        """Validates `data` (after applying `overrides`), raising one :class:`ConfigError` that
        lists every problem found."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(
                [
                    ConfigIssue(
                        "",
                        "the config must be a mapping of sections",
                        type(data).__name__,
                        "write the file as `section:` blocks, e.g. `batch:`",
                    )
                ],
                source,
            )
        issues: list[ConfigIssue] = []
        data = _apply_overrides(data, overrides or [], issues)
        cfg = None
        try:
            cfg = cls.model_validate(data)
        except ValidationError as exc:
            issues += _issues_from_validation(exc)
        # rules across fields run on every section that is valid by itself, so one pass
        # reports field errors and cross-field errors together
        sections = _valid_sections(cfg, data)
        issues += _cross_field_issues(sections)
        if issues:
            raise ConfigError(issues, source)
        assert cfg is not None
        return cfg

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: list[str] | None = None) -> TrainConfig:
        """Loads a YAML file; each override is `key.path=value`, the value parsed as YAML."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(
                [
                    ConfigIssue(
                        "",
                        "config file not found",
                        str(p),
                        "pass an existing YAML file, e.g. -c jobs/digits.yaml",
                    )
                ],
                str(p),
            )
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise ConfigError(
                [ConfigIssue("", f"not valid YAML: {exc}", _MISSING, "correct the YAML syntax")],
                str(p),
            ) from None
        return cls.from_dict(data or {}, overrides, source=str(p))

    def batch_plan(self, num_workers: int | None = None) -> BatchPlan:
        """The resolved batch plan for `num_workers` (default: the most workers the run uses)."""
        return resolve_batch_plan(
            num_workers=num_workers or self.scaling.max_workers,
            global_batch_size=self.batch.global_batch_size,
            micro_batch_size=self.batch.fixed_micro_batch_size,
            grad_accum_steps=self.batch.grad_accum_steps,
        )

    def elastic_summary(self) -> str:
        """Which worker counts of an elastic run keep the global batch (or what they do
        instead); raises BatchPlanError when none can run."""
        from rayacc.batch_plan import elastic_sizes

        lo, hi, policy = self.scaling.min_workers, self.scaling.max_workers, self.scaling.on_resize
        sizes = elastic_sizes(self.batch_plan(), lo, hi, policy)
        ok = {w: p for w, p in sizes.items() if isinstance(p, BatchPlan)}
        bad = {w: why for w, why in sizes.items() if isinstance(why, str)}
        if not ok:
            raise BatchPlanError(
                "scaling.num_workers",
                f"no worker count in [{lo}, {hi}] can run under {policy}",
                next(iter(bad.values())),
            )
        parts = [
            f"{w} → micro {p.micro_batch_size} × accum {p.grad_accum_steps}, global "
            f"{p.global_batch_size}"
            for w, p in ok.items()
        ]
        text = f"elastic run [{lo}, {hi}] ({policy}): " + "; ".join(parts)
        if bad:
            text += (
                f". Not at {', '.join(map(str, bad))} worker(s): {next(iter(bad.values()))};"
                " a restart at such a size stops with that message"
            )
        return text

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def flat(self) -> dict[str, Any]:
        """The config as dotted keys (`batch.micro_batch_size`), e.g. for tracking params."""
        return _flatten(self.model_dump(mode="json"))


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _apply_overrides(
    data: dict[str, Any], overrides: list[str], issues: list[ConfigIssue]
) -> dict[str, Any]:
    import copy

    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            issues.append(
                ConfigIssue(
                    "",
                    "override is not of the form key.path=value",
                    item,
                    "write e.g. batch.micro_batch_size=16",
                )
            )
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        node = data
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            prefix = tuple(parts[: i + 1])
            child = node.get(part)
            if child is None and not _is_value_field(prefix):
                child = node[part] = {}
            if not isinstance(child, dict):
                issues.append(
                    ConfigIssue(
                        ".".join(parts[: i + 1]),
                        "is a value, not a section",
                        _MISSING if child is None else child,
                        f"override {'.'.join(parts[: i + 1])}=VALUE instead",
                    )
                )
                break
            node = child
        else:
            node[parts[-1]] = value
    return data


def _is_value_field(loc: tuple[str, ...]) -> bool:
    """True when `loc` names a known field that holds a plain value (not a section or mapping)."""
    model: type[BaseModel] = TrainConfig
    for part in loc[:-1]:
        field = model.model_fields.get(part)
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return False
        model = ann
    field = model.model_fields.get(loc[-1])
    if field is None:
        return False
    ann = field.annotation
    is_section = isinstance(ann, type) and issubclass(ann, BaseModel)
    return not is_section and get_origin(ann) is not dict


def _section_fields(loc: tuple[Any, ...]) -> list[str]:
    model: type[BaseModel] = TrainConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None) if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def _description(loc: tuple[Any, ...]) -> str | None:
    model: type[BaseModel] = TrainConfig
    for i, part in enumerate(loc):
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        if i == len(loc) - 1:
            return field.description
        ann = field.annotation
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return None


def _fix_for(kind: str, ctx: dict[str, Any]) -> str | None:
    bounds = {
        "greater_than": ">",
        "greater_than_equal": ">=",
        "less_than": "<",
        "less_than_equal": "<=",
    }
    if kind in bounds:
        bound = next(iter(v for k, v in ctx.items() if k in ("gt", "ge", "lt", "le")), "")
        return f"set a value {bounds[kind]} {bound}"
    if kind == "literal_error":
        return f"use one of {ctx.get('expected', '')}"
    return {
        "int_parsing": "use a whole number",
        "int_type": "use a whole number",
        "int_from_float": "use a whole number",
        "float_parsing": "use a number",
        "float_type": "use a number",
        "bool_parsing": "use true or false",
        "bool_type": "use true or false",
        "string_type": "use a string (quote it in YAML)",
        "model_type": "write it as a section of key: value lines",
        "dict_type": "write it as a mapping of key: value",
        "list_type": "write it as a list, e.g. [1, 2]",
        "tuple_type": "write it as a list of two values, e.g. [1, 2]",
    }.get(kind)


_UNION_TAGS = {"int", "float", "str", "bool", "none", "list", "dict", "tuple"}


def _is_union_tag(part: str) -> bool:
    """pydantic names the branch of a union field in the error location (`constrained-int`,
    `literal['auto']`, `tuple[int, int]`); field names never look like that."""
    return "[" in part or "-" in part or part in _UNION_TAGS


def _merge_union_branches(issues: list[ConfigIssue]) -> list[ConfigIssue]:
    """One issue per field: a value that fits no branch of a union gets the branches' fixes."""
    merged: dict[str, ConfigIssue] = {}
    out: list[ConfigIssue] = []
    for issue in issues:
        first = merged.get(issue.path)
        if first is None or issue.message == "unknown key":
            merged[issue.path] = issue
            out.append(issue)
            continue
        fixes = [f for f in (first.fix, issue.fix) if f]
        combined = ConfigIssue(
            issue.path, "is not a valid value", first.value, "; or ".join(dict.fromkeys(fixes))
        )
        combined.loc = issue.loc
        out[out.index(first)] = combined
        merged[issue.path] = combined
    return out


def _issues_from_validation(exc: ValidationError) -> list[ConfigIssue]:
    issues = []
    for err in exc.errors(include_url=False):
        loc = tuple(p for p in err["loc"] if isinstance(p, str) and not _is_union_tag(p))
        path = ".".join(loc)
        kind = err["type"]
        if kind == "extra_forbidden":
            valid = _section_fields(loc[:-1])
            close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
            prefix = ".".join(loc[:-1])
            fix = (
                f"did you mean {(prefix + '.' if prefix else '') + close[0]!r}?"
                if close
                else f"valid keys here: {', '.join(valid)}"
            )
            issues.append(ConfigIssue(path, "unknown key", _MISSING, fix))
            continue
        if kind == "value_error":
            # a section's own cross-field rule: the message already names fields and fix
            msg = str(err["msg"]).removeprefix("Value error, ")
            issues.append(ConfigIssue(path, msg, _MISSING))
            continue
        value = err.get("input", _MISSING)
        if isinstance(value, dict):
            value = _MISSING
        issue = ConfigIssue(path, str(err["msg"]), value, _fix_for(kind, err.get("ctx") or {}))
        issue.loc = loc
        issues.append(issue)
    issues = _merge_union_branches(issues)
    for issue in issues:
        desc = _description(issue.loc) if issue.loc else None
        if desc:
            desc = " ".join(desc.split())
            issue.fix = f"{issue.fix} — {desc}" if issue.fix else desc
    return issues


_SECTIONS: dict[str, type[BaseModel]] = {
    name: field.annotation  # type: ignore[misc]
    for name, field in TrainConfig.model_fields.items()
    if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
}


def _valid_sections(cfg: TrainConfig | None, data: dict[str, Any]) -> dict[str, Any]:
    if cfg is not None:
        return {name: getattr(cfg, name) for name in _SECTIONS}
    sections = {}
    for name, model in _SECTIONS.items():
        raw = data.get(name, {})
        try:
            sections[name] = model.model_validate(raw if raw is not None else {})
        except ValidationError:
            continue
    return sections


def _cross_field_issues(s: dict[str, Any]) -> list[ConfigIssue]:
    """Rules that involve several fields, checked on whichever sections are valid."""
    issues: list[ConfigIssue] = []
    model: ModelConfig | None = s.get("model")
    if model is not None:
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
        if model.factory and model.factory.count(":") != 1:
            issues.append(
                ConfigIssue(
                    "model.factory",
                    "is not of the form 'package.module:function'",
                    model.factory,
                    "write e.g. mypkg.models:build",
                )
            )
        bad = [h for h in model.hidden_sizes if h < 1]
        if bad:
            issues.append(
                ConfigIssue(
                    "model.hidden_sizes",
                    "must hold positive integers",
                    model.hidden_sizes,
                    "e.g. [128, 128]",
                )
            )
        if model.n_embd % model.n_head:
            issues.append(
                ConfigIssue(
                    "model.n_head",
                    f"does not divide model.n_embd={model.n_embd}",
                    model.n_head,
                    f"set model.n_embd to a multiple of {model.n_head}, "
                    "or model.n_head to a divisor "
                    f"of {model.n_embd}",
                )
            )
        data: DataConfig | None = s.get("data")
        if model.name == "gpt" and data is not None and data.seq_len > model.block_size:
            issues.append(
                ConfigIssue(
                    "data.seq_len",
                    f"is longer than model.block_size={model.block_size}",
                    data.seq_len,
                    f"set data.seq_len <= {model.block_size}, or raise model.block_size",
                )
            )
    batch: BatchConfig | None = s.get("batch")
    scaling: ScalingConfig | None = s.get("scaling")
    if scaling is not None:
        lo, hi = scaling.min_workers, scaling.max_workers
        if lo < 1 or hi < lo:
            issues.append(
                ConfigIssue(
                    "scaling.num_workers",
                    "must be a positive count or [min, max] with 1 <= min <= max",
                    scaling.num_workers,
                    "e.g. 2, or [1, 4] for an elastic run",
                )
            )
            scaling = None
        elif not scaling.elastic:
            # compared with the defaults, not "was it set": a dumped config sets every field
            ignored = {
                name
                for name in ("on_resize", "resize_interval_s")
                if getattr(scaling, name) != ScalingConfig.model_fields[name].default
            }
            if ignored:
                issues.append(
                    ConfigIssue(
                        "scaling." + sorted(ignored)[0],
                        "only applies to elastic runs",
                        _MISSING,
                        "give scaling.num_workers as [min, max], or remove it",
                    )
                )
    if batch is not None and batch.auto_micro_batch:
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
    if batch is not None and scaling is not None:
        try:
            resolve_batch_plan(
                num_workers=scaling.max_workers,
                global_batch_size=batch.global_batch_size,
                micro_batch_size=batch.fixed_micro_batch_size,
                grad_accum_steps=batch.grad_accum_steps,
            )
        except BatchPlanError as exc:
            issues.append(ConfigIssue(exc.field, exc.problem, _MISSING, exc.fix))
    return issues


class RandomSearch(_Section):
    samples: int = Field(0, ge=0)
    """Random trials drawn in addition to the grid."""
    seed: int = 0
    """Seeds the draws."""
    space: dict[str, dict[str, list[Any]]] = Field(default_factory=dict)
    """Key path → one distribution: {choice: [..]}, {uniform: [lo, hi]}, {loguniform: [lo, hi]}
    or {randint: [lo, hi]} (hi exclusive)."""


class SweepConfig(_Section):
    """A sweep: a base training config and the settings to try."""

    name: str | None = None
    """The parent MLflow run's name; null = generated."""
    base: str | None = None
    """Path of the base training config (relative to the sweep file), or null with `config:`."""
    config: dict[str, Any] | None = None
    """The base training config inline (instead of `base`)."""
    overrides: list[str] = Field(default_factory=list)
    """key.path=value overrides applied to the base before the trials' own settings."""
    hold: Literal["global_batch_size"] | None = "global_batch_size"
    """`global_batch_size`: every trial keeps the base global batch; accumulation is derived.
    null: trials may change the global batch."""
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    """Key path → values; every combination is a trial."""
    random: RandomSearch = Field(default_factory=RandomSearch)
    max_concurrent_trials: int | None = Field(None, ge=1)
    """Trials at once; null = as many as the cluster's CPUs (or GPUs) fit."""

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> tuple[SweepConfig, dict[str, Any], str]:
        """(sweep, base config as a dict with overrides applied, source label)."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(
                [
                    ConfigIssue(
                        "",
                        "sweep file not found",
                        str(p),
                        "pass an existing YAML file, e.g. -c jobs/sweep_accum.yaml",
                    )
                ],
                str(p),
            )
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(
                [ConfigIssue("", f"not valid YAML: {exc}", _MISSING, "correct the YAML syntax")],
                str(p),
            ) from None
        try:
            sweep = cls.model_validate(raw)
        except ValidationError as exc:
            raise ConfigError(_issues_from_validation_of(exc, cls), str(p)) from None
        if (sweep.base is None) == (sweep.config is None):
            raise ConfigError(
                [
                    ConfigIssue(
                        "base",
                        "give exactly one of `base` (a file) and `config` (inline)",
                        _MISSING,
                        "e.g. base: digits.yaml",
                    )
                ],
                str(p),
            )
        if sweep.base is not None:
            base_path = (p.parent / sweep.base).resolve()
            base = TrainConfig.from_yaml(base_path, sweep.overrides)
        else:
            base = TrainConfig.from_dict(sweep.config or {}, sweep.overrides, source=str(p))
        return sweep, base.model_dump(mode="json"), str(p)


def _issues_from_validation_of(exc: ValidationError, model: type[BaseModel]) -> list[ConfigIssue]:
    issues = []
    for err in exc.errors(include_url=False):
        path = ".".join(str(x) for x in err["loc"])
        value = err.get("input", _MISSING)
        msg = "unknown key" if err["type"] == "extra_forbidden" else str(err["msg"])
        issues.append(
            ConfigIssue(
                path,
                msg,
                _MISSING if isinstance(value, dict) else value,
                f"valid keys: {', '.join(model.model_fields)}"
                if err["type"] == "extra_forbidden"
                else None,
            )
        )
    return issues
