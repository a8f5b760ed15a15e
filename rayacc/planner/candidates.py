"""The planner's candidates: every combination of workers, micro-batch (accumulation derived),
strategy and activation checkpointing that keeps the job's global batch exactly. FSDP's
variants are candidates too: its shards offloaded to host memory, and HSDP (one replica group
per node) where the workers span several nodes. DeepSpeed's
ZeRO stages (with and without optimizer offload) are candidates of a job that runs DeepSpeed
(`train.strategy: deepspeed`: the extra is there)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from rayacc.config.strategies import DEFAULT_STRATEGY
from rayacc.engine.autobatch import candidate_micro_sizes
from rayacc.engine.parallel import strategy_class, strategy_classes

__all__ = [
    "Candidate",
    "checkpointing_choices",
    "enumerate_candidates",
    "nodes_spanned",
    "sharding_variants",
    "strategy_modes",
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

    @property
    def global_batch_size(self) -> int:
        return self.workers * self.micro_batch_size * self.grad_accum_steps

    @property
    def shard_ranks(self) -> int:
        """The ranks each parameter is sharded over (FSDP's shard group)."""
        return self.workers // self.replicate

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


def enumerate_candidates(
    global_batch_size: int,
    worker_counts: list[int],
    num_blocks: int,
    *,
    micro_sizes: list[int] | None = None,
    job_strategy: str = DEFAULT_STRATEGY,
    workers_per_node: int | None = None,
) -> tuple[list[Candidate], list[str]]:
    """Every candidate, and a line for each worker count that cannot keep the global batch.
    `micro_sizes` limits the micro-batches tried (a benchmark's small grid); a strategy is tried
    from its wing's `min_workers` on (FSDP and ZeRO have nothing to shard on one);
    `job_strategy`: the strategy the job runs (ZeRO's modes are tried where it is DeepSpeed);
    `workers_per_node`: how the workers spread over nodes (HSDP's candidates where they span
    several)."""
    out: list[Candidate] = []
    skipped: list[str] = []
    for n in worker_counts:
        if global_batch_size % n:
            skipped.append(
                f"{n} workers: the global batch {global_batch_size} does not split evenly"
            )
            continue
        share = global_batch_size // n
        micros = [
            m for m in candidate_micro_sizes(share) if micro_sizes is None or m in micro_sizes
        ]
        nodes = nodes_spanned(n, workers_per_node)
        for base in strategy_modes(job_strategy):
            if n < strategy_class(base["strategy"]).min_workers:
                continue
            for mode in sharding_variants(base, nodes, n):
                for ac in checkpointing_choices(num_blocks):
                    out.extend(
                        Candidate(n, m, share // m, checkpointing=ac, **mode)
                        for m in sorted(micros)
                    )
    return out, skipped
