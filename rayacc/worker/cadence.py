"""When a window boundary does more than step: the one rule the loop asks (validate? checkpoint?
the group's last step?) and a reclaim's budget counts ahead with (worker/preemption.py). The
step record goes to the driver at every boundary; the outbox owns when it travels
(worker/progress.py)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Cadence"]


@dataclass(frozen=True)
class Cadence:
    """The boundaries of one worker group's steps."""

    last_step: int
    """The step this group ends at: the run's last, or where `train.max_steps` stops it."""
    val_every: int | None
    checkpoint_every: int | None
    validates: bool
    """The run holds validation rows."""

    def is_last(self, step: int) -> bool:
        return step >= self.last_step

    def should_validate(self, step: int) -> bool:
        every = self.val_every
        return self.validates and (self.is_last(step) or bool(every and step % every == 0))

    def should_checkpoint(self, step: int) -> bool:
        every = self.checkpoint_every
        return self.is_last(step) or bool(every and step % every == 0)
