"""The config schema: one pydantic section per concern, each field with its docstring (which
error messages quote as the fix), and :class:`TrainConfig`, the whole configuration of a run."""

from __future__ import annotations

import os
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Field, PrivateAttr, ValidationError

from rayacc.config.batch_schedule import BatchPhase
from rayacc.config.batch_split import BatchSplit, resolve_batch_split
from rayacc.config.environment import environment_issues
from rayacc.config.errors import ConfigError, ConfigIssue, issues_from_validation
from rayacc.config.features import DataKind, composition_issues
from rayacc.config.finetune import LoraConfig
from rayacc.config.loader import read_yaml
from rayacc.config.mesh import Mesh
from rayacc.config.overrides import apply_overrides, flatten
from rayacc.config.parallel import (
    PIPELINE_SCHEDULES,
    Count,
    DeepSpeedConfig,
    FSDPConfig,
    Section,
)
from rayacc.config.rules import cross_field_issues
from rayacc.config.strategies import DEFAULT_STRATEGY, strategies
from rayacc.config.strings import PLACE, string_issues

__all__ = [
    "BatchConfig",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "RunConfig",
    "ScalingConfig",
    "Section",
    "TrackingConfig",
    "TrainConfig",
    "TrainSection",
]


StrategyName = Literal[tuple(strategies())]  # type: ignore[valid-type]
"""The registry's names (config/strategies.py), plugins' included."""
Beta = Annotated[float, Field(ge=0.0, lt=1.0)]


class HFModelConfig(Section):
    """`model.name: hf`: a Hugging Face `transformers` causal LM (`pip install 'rayacc[hf]'`);
    nothing is fetched from the Hub, and no code a config or folder names is run."""

    config: str | dict[str, Any] | None = None
    """The model's `transformers` config: a local `config.json` or a folder holding one, or a
    mapping with `model_type` (e.g. {model_type: llama, hidden_size: 256, ...}); null: the
    config.json of `model.hf.weights`. Read once, on the driver."""
    weights: str | None = None
    """A local folder of `save_pretrained` weights, readable on every node; null: from `seed`."""


class ModelConfig(Section):
    name: Literal["mlp", "gpt", "factory", "hf"] = "mlp"
    """Model family: `mlp` (classification on feature vectors), `gpt` (causal LM on tokens),
    `factory` to build the model with `model.factory`, or `hf` (a `transformers` causal LM,
    `model.hf`)."""
    factory: str | None = None
    """User model factory as "package.module:function"; called with `model.kwargs` and the dataset
    info; used only when `model.name` is `factory`."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed to `model.factory`."""
    hidden_sizes: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [128, 128])
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
    hf: HFModelConfig = Field(default_factory=HFModelConfig)
    """`model.name: hf`: the `transformers` model's config and weights."""
    lora: LoraConfig | None = None
    """LoRA adapters on a frozen base (`gpt`, `hf`, a factory naming `target_modules`)."""


class DataConfig(Section):
    source: str = Field("digits", json_schema_extra=PLACE)
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
    cache_dir: str | None = Field(None, json_schema_extra=PLACE)
    """A local folder where bundled datasets are prepared as Parquet (default: ~/.cache/rayacc)."""
    order: Literal["auto", "chunks", "rows"] = "auto"
    """The data order's unit (docs/design.md). `chunks`: an epoch is a seeded permutation of
    Parquet row groups, rows shuffled inside each; a rank reads only the groups its windows draw
    from (about one read of each row per epoch, memory bounded by the prefetch). `rows`: one
    seeded permutation of all rows, each rank reading every row group each epoch: for data that
    fits. `auto`: `rows` up to `data.exact_order_max_mb` (uncompressed), else `chunks`."""
    exact_order_max_mb: float = Field(1024.0, ge=0.0)
    """`order: auto`: the largest data (MiB, uncompressed, from the Parquet metadata) read in
    the exact per-row order."""
    in_process_read_max_mb: float = Field(16.0, ge=0.0)
    """Data up to this size (MiB, uncompressed, from the Parquet metadata) is read by each rank
    in its own process with pyarrow instead of by Ray Data read tasks (whose start costs more
    than a small read). 0 reads all data through Ray Data."""
    materialize: bool | None = None
    """No longer used (every rank reads its rows through Ray Data): ignored, with a warning."""


class BatchConfig(Section):
    global_batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer step over all workers (micro_batch_size × grad_accum_steps ×
    num_workers): the invariant kept when the number of workers changes."""
    micro_batch_size: Count | Literal["auto"] | None = None
    """Samples per worker per forward/backward (micro-step), or `auto`: before training, the
    largest divisor of one worker's share whose forward + backward fits the memory budget on
    every rank (the global batch kept exactly); on a GPU an out-of-memory error later halves it
    on all ranks and redoes the window."""
    grad_accum_steps: int | None = Field(None, ge=1)
    """Micro-steps per optimizer step on each worker; derived from the other two when omitted."""
    micro_batch_by_workers: dict[Count, Count] = Field(default_factory=dict)
    """Elastic runs: the micro-batch at each worker count (written by `rayacc plan --search`,
    set by `train --plan`); a count not listed derives one."""
    memory_budget: float = Field(0.9, gt=0.0, le=1.0)
    """`micro_batch_size: auto` on GPU: share of the device's memory a micro-step may use."""
    memory_budget_mb: float | None = Field(None, gt=0.0)
    """`micro_batch_size: auto`: memory a micro-step may use per worker, in MiB (required on
    CPU, where it is checked against parameters, gradients, optimizer state and activations;
    on GPU it replaces `batch.memory_budget`)."""
    schedule: list[BatchPhase] | Literal["auto"] = Field(default_factory=list)
    """Phases of the global batch over the samples trained, or `auto`: it follows the gradient
    noise scale in powers of two (config/batch_schedule.py)."""
    min_global_batch_size: int | None = Field(None, ge=1)
    """`schedule: auto`: the least it goes to (default: `global_batch_size`, where it starts)."""
    max_global_batch_size: int | None = Field(None, ge=1)
    """`schedule: auto`: the most it goes to."""
    balance: Literal["off", "auto"] = "off"
    """`auto`: a window's rows split over the ranks by their measured time per row."""

    @property
    def auto_micro_batch(self) -> bool:
        return self.micro_batch_size == "auto"

    @property
    def fixed_micro_batch_size(self) -> int | None:  # None when omitted or `auto`
        return None if self.micro_batch_size == "auto" else self.micro_batch_size


class OptimConfig(Section):
    name: Literal["adamw", "adam", "sgd"] = "adamw"
    """Optimizer (Adam's weight decay is an L2 penalty, AdamW's decoupled)."""
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
    """Decoupled weight decay (AdamW) or L2 penalty (Adam, SGD)."""
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    """Adam's betas."""
    warmup_steps: int = Field(0, ge=0)
    """Linear LR warmup, in global batches of samples (optimizer steps at the planned global
    batch; the schedule counts samples, so a changed global batch does not move it)."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """LR after warmup: cosine decay to `optim.min_lr_ratio` × LR at the last step, or constant."""
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    """Final LR of the cosine schedule as a share of the effective LR."""
    max_grad_norm: float | None = Field(None, gt=0.0)
    """Clip the global gradient norm to this value after unscaling; null = no clipping."""
    fused: bool | None = None
    """The optimizer's fused kernel (one per parameter, not several per tensor); null = on."""


class EveryN(Section):
    every_n: int = Field(ge=1)
    """Checkpoint every n-th transformer block (1 = all)."""


class TrainSection(Section):
    max_steps: int | None = Field(None, ge=1)
    """Optimizer steps to run; null = run `train.epochs` epochs."""
    epochs: int | None = Field(None, ge=1)
    """Passes over the training rows; null = one, or as many as `train.max_steps` needs when it
    is set (as Hugging Face's Trainer does); a number given bounds `train.max_steps`."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute precision: fp32, bf16 autocast, or fp16 autocast with a gradient scaler."""
    val_every_steps: int | None = Field(None, ge=1)
    """Run validation every N optimizer steps (and always at the end); null = only at the end."""
    checkpoint_every_steps: int | None = Field(None, ge=1)
    """Checkpoint every N optimizer steps (and always at the end); null = only at the end."""
    checkpoint_mode: Literal["async", "sync"] = "async"
    """`async`: training waits only while the state is copied off the device (on CPU, a
    snapshot) and, under FSDP, staged; writing the files and copying them into the run's
    storage overlap the next windows. At most one checkpoint is in flight (the next waits for
    it), one is reported to Ray Train (and so resumed from) only once complete, and the run's
    last checkpoint and those a reclaim asks for are waited for. `sync`: every rank waits
    until the checkpoint is in storage."""
    checkpoint_on_preemption: bool = True
    """When a node of the run is reclaimed with notice (a spot or preemptible instance that Ray
    drains for preemption): checkpoint at the next window, train on, write a last checkpoint
    before the deadline and wait there for the restart without that node, so no step is
    recomputed. The ranks learn of a notice with the window's counts (no collective of its
    own); false = only the periodic checkpoints survive a reclaim."""
    compile: bool = False
    """torch.compile the model (before DDP wraps it; under FSDP each block, before sharding);
    the first steps pay the compilation."""
    allow_tf32: bool = False
    """GPU, fp32 precision: let matmuls and convolutions use TF32 tensor cores (about 10 bits
    of mantissa instead of 23: faster, not bit-equal to fp32)."""
    loss_chunk_tokens: int | None = Field(8192, ge=1)
    """Token models with an output head (`gpt`): compute the vocabulary projection and
    cross-entropy this many positions at a time, so fp32 logits of a whole micro-batch are never
    held; null = all at once."""
    strategy: StrategyName = DEFAULT_STRATEGY  # type: ignore[valid-type]
    """`ddp`: every rank holds the whole model (DistributedDataParallel). `fsdp`: parameters,
    gradients and optimizer state sharded over the ranks (FSDP2, per transformer block and at
    the root; see the `fsdp` section), for models that do not fit one device. `deepspeed`:
    DeepSpeed ZeRO (see the `deepspeed` section)."""
    tensor_parallel: int = Field(1, ge=1)
    """Ranks each layer is split over (tensor parallelism: the `gpt` model's heads and MLP, or
    the plan transformers declares for an `hf` model), under train.strategy=fsdp; 1 = none.
    `scaling.num_workers` = data-parallel ranks × this, and the global batch is micro ×
    accumulation × data-parallel ranks (a tensor-parallel group reads the same rows)."""
    pipeline_parallel: int = Field(1, ge=1)
    """Pipeline stages the model is cut into (embeddings first, head last, blocks balanced by
    parameters), under train.strategy=fsdp, each stage sharded over its data-parallel ranks;
    1 = none. `scaling.num_workers` = data-parallel ranks × this; a window's micro-batches
    are the schedule's (accumulation ≥ this keeps the bubble small), each stage's gradients
    reduced once per window (whatever fsdp.grad_sync) and the logits whole (no loss chunks)."""
    pipeline_schedule: Literal[PIPELINE_SCHEDULES] = "1f1b"  # type: ignore[valid-type]
    """`gpipe` (every forward, then every backward), `1f1b` (one forward, one backward: fewer
    activations held), `interleaved_1f1b` (several stages per rank: a smaller bubble), `zbv`
    (two stages per rank in a V, the backward split in two; one rank per stage)."""
    pipeline_stages_per_rank: int = Field(2, ge=2)
    """Stages each rank runs under `interleaved_1f1b`."""
    activation_checkpointing: Literal["none", "full"] | EveryN = "none"
    """Recompute transformer blocks' activations in backward instead of keeping them: `full`
    (every block), `{every_n: k}` (every k-th block) or `none`. Less activation memory for
    about one more forward of compute; the step is unchanged (to rounding)."""
    loss: str | None = None
    """The user's objective, `package.module:function`, called per micro-batch as
    `function(output, batch)` → (sum of its loss items, their count); null: cross-entropy."""
    straggler_margin: float = Field(0.3, gt=0.0)
    """A rank is named a straggler (console line, `rayacc.stragglers` tag) when its own time per
    window (compute, data wait, optimizer; not the wait for peers) stays this far above the
    others' median (0.3 = 30 %, at least 0.1 s) for two logging intervals (a tenth of the run
    each) in a row; the part furthest above is named with it."""
    peak_tflops: float | None = Field(None, gt=0.0)
    """Peak TFLOP/s of one worker's device for `perf/mfu`; null = a known GPU's dense peak at
    the run's precision (H200, H100, A100, L4, A10G: `engine/perf.PEAK_TFLOPS`), none on a CPU
    or another device (then only `perf/tflops` is logged; set it to see MFU there)."""


class ScalingConfig(Section):
    num_workers: Count | tuple[Count, Count] = 2
    """Data-parallel training workers (one DDP rank each), or [min, max] for an elastic run:
    Ray starts as many as fit and restarts the group at a new size when capacity changes."""
    on_resize: Literal["keep_global_batch", "keep_micro_batch"] = "keep_global_batch"
    """Elastic runs: `keep_global_batch` keeps the global batch and effective LR at any size
    (accumulation re-derived; uneven shares where the size does not divide it);
    `keep_micro_batch`: the global batch and the LR (`optim.lr_scaling`) follow the workers."""
    resize_interval_s: float = Field(60.0, gt=0)
    """Elastic runs: how often Ray checks whether more workers fit."""
    use_gpu: bool = False
    """One GPU per worker (NCCL); CPU workers use gloo."""
    cpus_per_worker: float = Field(1.0, gt=0.0)
    """Logical CPUs reserved per worker (fractions allowed)."""
    extra_resources: dict[str, Annotated[float, Field(gt=0.0)]] = Field(default_factory=dict)
    """Custom Ray resources each worker needs besides CPUs/GPUs, e.g. {worker_slot: 1} on nodes
    that offer one slot each. Elastic sizing counts resources, not the placement strategy, so
    this is how an elastic run is held to one worker per node."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How Ray places the workers on nodes: PACK fills few nodes, SPREAD spreads when it can,
    STRICT_SPREAD puts every worker on its own node."""
    workers_per_node: Count | None = None
    """`rayacc plan --search`: workers per node (filled in turn, as Ray's PACK places them):
    which collectives cross nodes, HSDP where workers span several; null: the cluster's."""
    inter_node_gbps: float = Field(25.0, gt=0)
    """`rayacc plan --search`: the bandwidth between nodes (Gbit/s) a collective crossing them
    runs at, at most (25: a common cloud network; set what your nodes' all-reduce measures)."""
    start_timeout_s: float | None = Field(None, gt=0)
    """How long Ray Train waits to place a worker group at a size before it gives up on that
    size (`RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`, sent to its controller with the run). After
    a node is lost without notice, Ray Train first retries the old size and waits this long
    before going smaller. null: 10 s for an elastic run (smaller within seconds, not a minute
    of the whole group idle), Ray's own 60 s otherwise (a fixed size only waits for capacity).
    A driver that joins a Ray already started in its process (a notebook's `ray.init`) keeps
    that Ray's setting."""

    @property
    def elastic(self) -> bool:
        return not isinstance(self.num_workers, int)

    @property
    def keeps_global_batch(self) -> bool:
        """The global batch holds at every size the run has (a fixed count, or an elastic one
        that keeps it): where the ranks do not divide it, they take uneven shares."""
        return not self.elastic or self.on_resize == "keep_global_batch"

    def ray_train_env(self) -> dict[str, str]:
        """What the run's Ray job hands Ray Train's controller (`start_timeout_s`)."""
        timeout = self.start_timeout_s or (10.0 if self.elastic else None)
        return {} if timeout is None else {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": f"{timeout:g}"}

    @property
    def min_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[0]

    @property
    def max_workers(self) -> int:
        return self.num_workers if isinstance(self.num_workers, int) else self.num_workers[1]

    def resources_per_worker(self) -> dict[str, float]:
        """What one training worker asks Ray for besides its GPU (Ray Train's
        `ScalingConfig(resources_per_worker=..., use_gpu=...)`)."""
        return {"CPU": self.cpus_per_worker, **self.extra_resources}

    def worker_needs(self) -> dict[str, float]:
        """Everything one training worker asks Ray for, its GPU included."""
        gpu = {"GPU": 1.0} if self.use_gpu else {}
        return {"CPU": self.cpus_per_worker, **gpu, **self.extra_resources}


class TrackingConfig(Section):
    enabled: bool = True
    """Record the run in MLflow."""
    tracking_uri: str | None = Field(None, json_schema_extra=PLACE)
    """MLflow tracking URI; null = `MLFLOW_TRACKING_URI` where set, else
    sqlite:///<cwd>/mlflow.db."""
    experiment: str | None = None
    """MLflow experiment name; null = `MLFLOW_EXPERIMENT_NAME` where set, else `rayacc`."""
    run_name: str | None = None
    """MLflow run name; null = generated."""
    system_metrics: bool = False
    """Record each node's CPU, memory (and NVIDIA GPU) use as MLflow system metrics
    (`system/<node>/<name>`) every tenth of the run, sampled by MLflow's own monitors on each
    node's first rank and carried with the ranks' figures. Off by default."""


class RunConfig(Section):
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    """Name of the run's folder under `run.storage_path`: letters, digits, `.`, `_` and `-`,
    starting with a letter or digit, at most 128 characters (a `/` or `..` would put the run
    outside the storage path, or inside another run); null = a fresh unique name."""
    storage_path: str | None = Field(None, json_schema_extra=PLACE)
    """Where checkpoints and run state go (absolute path or URI; shared storage on a multi-node
    cluster); null = <cwd>/rayacc_runs."""
    max_failures: int = Field(0, ge=-1)
    """Worker-group restarts from the latest checkpoint after a failure; -1 = unlimited."""
    keep_checkpoints: int = Field(2, ge=1)
    """Checkpoints kept on storage (the newest)."""


class TrainConfig(Section):
    """The whole configuration of one training run."""

    seed: int = Field(0, ge=0)
    """Seeds the model initialisation, the data order and each rank's random stream."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainSection = Field(default_factory=TrainSection)
    fsdp: FSDPConfig = Field(default_factory=FSDPConfig)
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    scaling: ScalingConfig = Field(default_factory=ScalingConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    _source_file: str | None = PrivateAttr(None)
    _overrides: list[str] = PrivateAttr(default_factory=list)  # the ones read over it

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
        data = apply_overrides(data, overrides or [], issues, cls)
        cfg = None
        try:
            cfg = cls.model_validate(data)
        except ValidationError as exc:
            issues += issues_from_validation(exc, cls)
        issues += cross_field_issues(_valid_sections(cfg, data))
        if cfg is not None:
            issues += string_issues(cfg) + environment_issues(cfg)
        if issues:
            raise ConfigError(issues, source)
        assert cfg is not None
        return cfg

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: list[str] | None = None) -> TrainConfig:
        """Loads a YAML file; each override is `key.path=value`, the value parsed as YAML."""
        data = read_yaml(path, "config", "-c jobs/digits.yaml")
        cfg = cls.from_dict(data or {}, overrides, source=str(path))
        cfg._source_file, cfg._overrides = str(path), list(overrides or [])
        return cfg

    @property
    def source_file(self) -> str | None:
        """The job file this config was read from (None when built in code)."""
        return self._source_file

    @property
    def overrides(self) -> list[str]:
        return list(self._overrides)

    @property
    def mesh(self) -> Mesh:
        """The run's layout as the degrees of one mesh (config/mesh.py)."""
        return Mesh.of(self)

    def check_data_kind(self, kind: DataKind) -> None:
        """The pairs the data's kind brings (packed rows × a pipeline …): the one acceptance
        (config/features.py) run again where the data is read. Raises ConfigError."""
        sections = _valid_sections(self, {})
        if issues := composition_issues(sections, kind):
            raise ConfigError(issues, self._source_file)

    def batch_split(self, num_workers: int | None = None) -> BatchSplit:
        """The resolved batch split for `num_workers` (default: the most workers the run
        uses), over their data-parallel ranks."""
        return resolve_batch_split(
            num_workers=num_workers or self.scaling.max_workers,
            mesh=self.mesh,
            global_batch_size=self.batch.global_batch_size,
            micro_batch_size=self.batch.fixed_micro_batch_size,
            grad_accum_steps=self.batch.grad_accum_steps,
            uneven=self.scaling.keeps_global_batch,
        )

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def flat(self) -> dict[str, Any]:
        """The config as dotted keys (`batch.micro_batch_size`), e.g. for tracking params."""
        return flatten(self.model_dump(mode="json"))


def _valid_sections(cfg: TrainConfig | None, data: dict[str, Any]) -> dict[str, Any]:
    """The sections of `cfg`, or (when the whole config is invalid) those of `data` that are
    valid by themselves."""
    sections = {
        name: field.annotation
        for name, field in TrainConfig.model_fields.items()
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
    }
    if cfg is not None:
        return {name: getattr(cfg, name) for name in sections}
    valid = {}
    for name, model in sections.items():
        raw = data.get(name, {})
        try:
            valid[name] = model.model_validate(raw if raw is not None else {})
        except ValidationError:
            continue
    return valid
