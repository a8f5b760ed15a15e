"""The planner's candidates: every combination of workers, micro-batch (accumulation derived),
strategy and activation checkpointing that keeps the job's global batch exactly. FSDP's
variants are candidates too: its shards offloaded to host memory, and HSDP (one replica group
per node) where the workers span several nodes, tensor-parallel groups inside a node and
pipelines of stages under the strategies that compose with them. DeepSpeed's
ZeRO stages (with and without optimizer offload) are candidates of a job that runs DeepSpeed
(`train.strategy: deepspeed`: the extra is there)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rayacc.config.batch_split import data_parallel_ranks
from rayacc.config.mesh import Mesh
from rayacc.config.strategies import DEFAULT_STRATEGY
from rayacc.engine.autobatch import candidate_micro_sizes
from rayacc.engine.parallel import strategy_class, strategy_classes

__all__ = [
    "Candidate",
    "checkpointing_choices",
    "enumerate_candidates",
    "nodes_spanned",
    "rule_issues",
    "sharding_variants",
    "strategy_modes",
    "tensor_parallel_sizes",
    "with_candidate",
]


@dataclass(frozen=True)
class Candidate:
    """One way to run the job's global batch: `workers` × `micro_batch_size` ×
    `grad_accum_steps` samples per optimizer step."""

    workers: int
    micro_batch_size: int
    grad_accum_steps: int
    strategy: str = DEFAULT_STRATEGY
    grad_sync: str | None = None
    """fsdp.grad_sync under fsdp; None under ddp."""
    checkpointing: str | int = "none"
    """`none`, `full`, or k: every k-th transformer block."""
    zero_stage: int | None = None
    """deepspeed.stage under deepspeed; None otherwise."""
    offload: bool = False
    """deepspeed.offload_optimizer: cpu under deepspeed; fsdp.offload: cpu under fsdp."""
    replicate: int = 1
    """fsdp.replicate under fsdp: HSDP's replica groups (1: sharded over every worker)."""
    tensor_parallel: int = 1
    """The mesh's tensor degree: each layer split over this many workers (a group on one node)."""
    pipeline_parallel: int = 1
    """The mesh's pipeline degree: the layers cut into this many stages (the default
    schedule, 1F1B)."""

    @property
    def mesh(self) -> Mesh:
        return Mesh(self.pipeline_parallel, self.tensor_parallel)

    @property
    def data_parallel(self) -> int:
        """The ranks the batch splits over: the workers, or their model-parallel groups."""
        return data_parallel_ranks(self.workers, self.mesh.model_parallel)

    @property
    def global_batch_size(self) -> int:
        return self.data_parallel * self.micro_batch_size * self.grad_accum_steps

    @property
    def shard_ranks(self) -> int:
        """The ranks each parameter is sharded over (FSDP's shard group)."""
        return self.data_parallel // self.replicate

    @property
    def overhead_label(self) -> str:
        """The mode whose measured fixed costs this candidate pays (HSDP and FSDP's offload
        pay FSDP's in the same sync mode; their collectives and copies the prior counts)."""
        if self.zero_stage is not None:
            return f"{self.strategy} zero{self.zero_stage}" + (" offload" if self.offload else "")
        return self.strategy if self.grad_sync is None else f"{self.strategy} {self.grad_sync}"

    @property
    def strategy_label(self) -> str:
        label = self.overhead_label
        if self.replicate > 1:
            label += f" hsdp {self.replicate}×{self.shard_ranks}"
        if self.offload and self.zero_stage is None:
            label += " offload"
        if self.tensor_parallel > 1:
            label += f" tp{self.tensor_parallel}"
        if self.pipeline_parallel > 1:
            label += f" pp{self.pipeline_parallel}"
        return label

    @property
    def checkpointing_label(self) -> str:
        ac = self.checkpointing
        return ac if isinstance(ac, str) else f"every_{ac}"

    @property
    def label(self) -> str:
        """E.g. `2w 32×4 fsdp window_end ac=full`."""
        return (
            f"{self.workers}w {self.micro_batch_size}×{self.grad_accum_steps} "
            f"{self.strategy_label} ac={self.checkpointing_label}"
        )

    def overrides(self, *, with_workers: bool = True) -> dict[str, Any]:
        """The config keys this candidate sets (dotted paths)."""
        ac = self.checkpointing
        out: dict[str, Any] = {}
        if with_workers:
            out["scaling.num_workers"] = self.workers
        out["batch.micro_batch_size"] = self.micro_batch_size
        out["batch.grad_accum_steps"] = self.grad_accum_steps
        out["train.strategy"] = self.strategy
        out.update(self.mesh.overrides())
        out.update(strategy_class(self.strategy).candidate_overrides(self))
        out["train.activation_checkpointing"] = ac if isinstance(ac, str) else {"every_n": ac}
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Candidate:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def checkpointing_choices(num_blocks: int) -> list[str | int]:
    """Activation checkpointing settings worth trying for a model with `num_blocks`
    recomputable blocks: none without blocks (it would change nothing), else none, every
    other block (when there are 3 or more) and all."""
    if num_blocks == 0:
        return ["none"]
    return ["none", *([2] if num_blocks >= 3 else []), "full"]


def strategy_modes(job_strategy: str = DEFAULT_STRATEGY) -> list[dict[str, Any]]:
    """Each way to spread the model the planner tries, as Candidate fields, for a job that runs
    `job_strategy`: every registered strategy's modes (each wing says its own: FSDP's sync
    modes; DeepSpeed's ZeRO modes where the job runs DeepSpeed)."""
    return [mode for cls in strategy_classes().values() for mode in cls.planner_modes(job_strategy)]


def sharding_variants(mode: dict[str, Any], nodes: int, workers: int) -> list[dict[str, Any]]:
    """A mode and its variants at `workers` spread over `nodes` (FSDP's: its shards in host
    memory and HSDP)."""
    return strategy_class(mode["strategy"]).sharding_variants(mode, nodes, workers)


def nodes_spanned(workers: int, workers_per_node: int | None) -> int:
    """The nodes `workers` fill one after another (Ray's PACK), `workers_per_node` each (None:
    one node)."""
    return 1 if workers_per_node is None else -(-workers // workers_per_node)


def tensor_parallel_sizes(
    workers: int, allowed: list[int], workers_per_node: int | None
) -> list[int]:
    """The tensor-parallel group sizes tried at `workers`: 1, and each of `allowed` (those the
    model's plan and heads take) that divides the workers and fits one node (a group's
    collectives run every layer: it never crosses one)."""
    node = workers if workers_per_node is None else min(workers, workers_per_node)
    return [1, *(t for t in sorted(set(allowed)) if t > 1 and workers % t == 0 and t <= node)]


def enumerate_candidates(
    global_batch_size: int,
    worker_counts: list[int],
    num_blocks: int,
    *,
    micro_sizes: list[int] | None = None,
    job_strategy: str = DEFAULT_STRATEGY,
    workers_per_node: int | None = None,
    tensor_parallel: list[int] | None = None,
    pipeline: list[int] | None = None,
) -> tuple[list[Candidate], list[str]]:
    """Every candidate, and a line for each worker count that cannot keep the global batch.
    `micro_sizes` limits the micro-batches tried (a benchmark's small grid); a strategy is tried
    from its wing's `min_workers` on (FSDP and ZeRO have nothing to shard on one);
    `job_strategy`: the strategy the job runs (ZeRO's modes are tried where it is DeepSpeed);
    `workers_per_node`: how the workers spread over nodes (HSDP's candidates where they span
    several); `tensor_parallel`: the group sizes the model takes (`tensor_parallel_sizes`),
    `pipeline`: the stage counts it takes, each tried under the strategies that compose with
    it (a pipeline in the window-end sync mode alone: its stages reduce once a window
    whatever the mode)."""
    from rayacc.config.strategies import strategies

    entries = strategies().items()
    composes = {n for n, e in entries if e.without_tensor_parallel is None}
    pipelines = {n for n, e in entries if e.without_pipeline_parallel is None}
    out: list[Candidate] = []
    skipped: list[str] = []
    for n in worker_counts:
        meshes = [
            (t, p)
            for t in tensor_parallel_sizes(n, tensor_parallel or [], workers_per_node)
            for p in [1, *sorted(set(pipeline or []))]
            if (n // t) % p == 0
        ]
        for t, p in meshes:
            dp = data_parallel_ranks(n, t * p)
            if global_batch_size % dp:
                groups = f" in groups of {t * p}" if t * p > 1 else ""
                skipped.append(
                    f"{n} workers{groups}: the global batch {global_batch_size} does not "
                    "split evenly"
                )
                continue
            share = global_batch_size // dp
            micros = [
                m for m in candidate_micro_sizes(share) if micro_sizes is None or m in micro_sizes
            ]
            nodes = nodes_spanned(n, workers_per_node)
            for base in strategy_modes(job_strategy):
                if n < strategy_class(base["strategy"]).min_workers:
                    continue
                if t > 1 and base["strategy"] not in composes:
                    continue
                if p > 1 and (base["strategy"] not in pipelines or base.get("grad_sync")
                              not in (None, "window_end")):  # fmt: skip
                    continue
                for mode in sharding_variants(base, nodes, dp):
                    if p > 1 and mode.get("offload"):
                        continue
                    mesh = {"tensor_parallel": t, "pipeline_parallel": p, **mode}
                    for ac in checkpointing_choices(num_blocks):
                        out.extend(
                            Candidate(n, m, share // m, checkpointing=ac, **mesh)
                            for m in sorted(micros)
                        )
    return out, skipped


def _candidate_data(cfg, c: Candidate) -> dict[str, Any]:
    from rayacc.config.rules import strategy_resets

    data = cfg.model_dump(mode="json")
    for key, value in {**strategy_resets(cfg, c.strategy), **c.overrides()}.items():
        section, name = key.split(".")
        data[section][name] = value
    return data


def with_candidate(cfg, c: Candidate):
    """`cfg` (a TrainConfig) running candidate `c`: its fields validated, as a calibration
    group builds it (the rules across sections judge a candidate in `rule_issues`)."""
    from rayacc.config import TrainConfig

    return TrainConfig.model_validate(_candidate_data(cfg, c))


def rule_issues(cfg, c: Candidate) -> dict[tuple[str, str], str]:
    """What the config's rules, every one, say of `cfg` running `c`: (field, problem) → the
    issue as it reads."""
    from rayacc.config import ConfigError, TrainConfig

    try:
        TrainConfig.from_dict(_candidate_data(cfg, c))
    except ConfigError as exc:
        return {(i.path, i.message): str(i) for i in exc.issues}
    return {}
