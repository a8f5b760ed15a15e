"""The run's layout as the degrees of one mesh (torchtitan's `ParallelDims`): pipeline stages ×
data-parallel ranks (HSDP: replica groups × the ranks sharding each) × tensor-parallel ranks.
The one reader of the degrees' keys: every other module asks a `Mesh` for a degree, and for
its key where a message names it, so a new degree is a field here, its rules
(config/parallel.py), its wing (engine/parallel/) and the schema."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["Mesh", "idle_share"]


@dataclass(frozen=True)
class Mesh:
    pipeline: int = 1
    tensor: int = 1
    replicate: int | str = 1
    """HSDP's replica groups over the data-parallel ranks (`auto`: one per node; the FSDP
    wing's setting)."""
    schedule: str = "1f1b"
    """The pipeline's schedule."""
    looped: int = 2
    """Stages per rank of an interleaved schedule."""

    KEYS: ClassVar[dict[str, str]] = {
        "pipeline": "train.pipeline_parallel",
        "tensor": "train.tensor_parallel",
        "schedule": "train.pipeline_schedule",
        "looped": "train.pipeline_stages_per_rank",
    }

    @classmethod
    def of(cls, cfg: Any) -> Mesh:
        """The mesh of a `TrainConfig`."""
        return cls.of_sections(cfg.train, cfg.fsdp)

    @classmethod
    def of_sections(cls, train: Any, fsdp: Any = None) -> Mesh:
        """The mesh of the config's `train` (and `fsdp`) sections (None: no model parallelism)."""
        if train is None:
            return cls()
        return cls(
            train.pipeline_parallel,
            train.tensor_parallel,
            fsdp.replicate if fsdp is not None else 1,
            train.pipeline_schedule,
            train.pipeline_stages_per_rank,
        )

    @classmethod
    def key(cls, degree: str) -> str:
        """The config key of a degree (`tensor` → `train.tensor_parallel`)."""
        return cls.KEYS[degree]

    def setting(self, degree: str) -> str:
        """`key=value` of a degree, as messages quote it."""
        return f"{self.KEYS[degree]}={getattr(self, degree)}"

    @property
    def model_parallel(self) -> int:
        """Workers that hold the parts of one replica and read one share of the rows."""
        return self.pipeline * self.tensor

    def data_parallel(self, workers: int) -> int:
        """The ranks among `workers` the rows are split over."""
        return max(1, workers // self.model_parallel)

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each rank runs: an interleaved schedule's `looped`, ZBV's V two."""
        return {"interleaved_1f1b": self.looped, "zbv": 2}.get(self.schedule, 1)

    def in_flight(self, micro_steps: int) -> int:
        """The micro-batches whose activations the first stage holds at once: GPipe the
        window's, the others up to the stages (1 without a pipeline)."""
        if self.pipeline == 1:
            return 1
        return micro_steps if self.schedule == "gpipe" else min(micro_steps, self.pipeline)

    def bubble(self, micro_steps: int) -> float:
        """The schedule's idle share of a window of `micro_steps` micro-batches."""
        return idle_share(self.pipeline, self.stages_per_rank, micro_steps)

    def overrides(self) -> dict[str, Any]:
        """The config keys that set this mesh's model-parallel degrees and its schedule."""
        degrees = ("tensor", "pipeline", "schedule", "looped")
        return {self.KEYS[d]: getattr(self, d) for d in degrees}


def scheduled_micro_steps(schedule: str, pp: int, micro_steps: int) -> int:
    """The micro-batches a window of `micro_steps` runs as under `schedule` over `pp` ranks:
    the looped ones (interleaved 1F1B, ZBV) take a multiple of their rounds (max(1, m // P),
    torch's rule), the next such count — the rest filled with micro-batches of no rows."""
    if schedule not in ("interleaved_1f1b", "zbv"):
        return micro_steps
    m = micro_steps
    while m % max(1, m // pp):
        m += 1
    return m


def idle_share(pp: int, per_rank: int, micro_steps: int) -> float:
    """A pipeline schedule's idle share of a window, (P − 1) / (v·m + P − 1) for P stages' ranks
    running v stages each over m micro-batches (ZBV's V idles less: an upper bound there)."""
    return (pp - 1) / (per_rank * micro_steps + pp - 1) if micro_steps else 0.0
