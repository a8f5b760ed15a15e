"""Training progress that a checkpoint must carry to continue exactly."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["TrainState"]


@dataclass
class TrainState:
    """Counters of a run; the data position is in global-sample units so that a restart at
    another worker count continues at the same sample."""

    optimizer_step: int = 0
    """Optimizer steps taken (skipped non-finite steps included: they consumed their data)."""
    samples_seen: int = 0
    """Samples (rows) consumed over all workers."""
    items_seen: int = 0
    """Loss items (samples or target tokens) consumed over all workers."""
    epoch: int = 0
    """Current epoch (0-based)."""
    epoch_sample_offset: int = 0
    """Samples of the current epoch's order already consumed."""
    skipped_steps: int = 0
    """Steps skipped for a non-finite loss or gradient."""
    batch_phase: int = 0
    """`batch.schedule: auto`: the global batch is the configured one × 2^batch_phase."""
    batch_phase_step: int = 0
    """The step after which `batch_phase` last moved."""

    def advance(self, *, samples: int, items: int, skipped: bool) -> None:
        self.optimizer_step += 1
        self.samples_seen += samples
        self.items_seen += items
        self.epoch_sample_offset += samples
        self.skipped_steps += int(skipped)

    def start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.epoch_sample_offset = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        known = {f.name for f in fields(self)}
        unknown = set(state) - known
        if unknown:
            raise ValueError(f"unknown TrainState keys {sorted(unknown)}; expected {sorted(known)}")
        for key, value in state.items():
            setattr(self, key, int(value))
