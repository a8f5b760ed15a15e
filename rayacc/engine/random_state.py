"""A rank's random stream (dropout and anything else random), by the layout's rule: one stream
per data-parallel rank, so the ranks of a tensor-parallel group, which hold replicated
activations, draw alike. A checkpoint keeps every rank's state with its stream's place
(`stream`, `streams`); a resume restores the stream a rank runs in now, or seeds a fresh one
from the step where the data-parallel ranks changed (their rows changed too)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["RandomStreams", "rank_seed"]


def rank_seed(seed: int, *stream: int) -> int:
    """A seed for the random stream `stream` (e.g. a rank) of run seed `seed`: independent
    streams for different ranks, the same stream for the same (seed, rank) in every run."""
    return int(np.random.SeedSequence([seed, *stream]).generate_state(1, dtype=np.uint64)[0] >> 1)


@dataclass(frozen=True)
class RandomStreams:
    """This rank's place among the run's streams: `stream` its data-parallel rank, `streams`
    the data-parallel ranks."""

    seed: int
    stream: int
    streams: int
    device: torch.device

    def start(self) -> None:
        """The stream as a new run starts it."""
        torch.manual_seed(rank_seed(self.seed, self.stream))

    def state(self) -> dict[str, torch.Tensor | int | None]:
        cuda = self.device.type == "cuda"
        return {
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(self.device) if cuda else None,
            "stream": self.stream,
            "streams": self.streams,
        }

    def restore(self, saved: list[dict] | None, step: int) -> str:
        """Restores this rank's stream from a checkpoint's states (every rank's, in rank
        order) as the uninterrupted run has it; where the checkpoint has no state of this
        stream at this many streams, a fresh one seeded by (seed, stream, step), the same on
        every rank of the stream. Returns which: `restored` or `reseeded`."""
        mine = _of_stream(saved or [], self.stream, self.streams)
        if mine is None:
            torch.manual_seed(rank_seed(self.seed, self.stream, step))
            return "reseeded"
        torch.set_rng_state(mine["cpu"].cpu())
        if mine.get("cuda") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(mine["cuda"].cpu(), self.device)
        return "restored"

    @staticmethod
    def check(saved: object) -> None:
        """Raises ValueError unless `saved` is a list of states `state` writes (read before
        anything is restored: a checkpoint is loaded whole or passed over)."""
        if saved is None:
            return
        if not isinstance(saved, list) or not all(
            isinstance(s, dict) and isinstance(s.get("cpu"), torch.Tensor) for s in saved
        ):
            raise ValueError("its random states are not the list of every rank's states")
        for s in saved:
            if s["cpu"].dtype != torch.uint8 or s["cpu"].dim() != 1:
                raise ValueError("a random state is not a generator's byte state")


def _of_stream(saved: list[dict], stream: int, streams: int) -> dict | None:
    """The saved state of `stream` at `streams` streams. A checkpoint written before states
    carried their stream has one per rank, each rank its own stream (no tensor parallelism)."""
    if saved and all("stream" not in s for s in saved):
        saved = [{**s, "stream": r, "streams": len(saved)} for r, s in enumerate(saved)]
    return next(
        (s for s in saved if s.get("stream") == stream and s.get("streams") == streams), None
    )
