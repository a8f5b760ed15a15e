"""A user model factory whose worker processes fail on cue (real process deaths and stalls, not
exceptions), to exercise recovery from the latest checkpoint.

- `die_at_forward`: rank `die_rank` (negative: counted from the last) exits in its training
  forward of that number (counted from the process's start), once: `marker` records that it
  died. `kill=True` dies by SIGKILL instead of `os._exit(1)`.
- `phase_marker`: while that file does not exist, rank 0 stalls (up to 120 s) in its training
  forward `hold_at_forward` and no rank dies: the test kills the driver meanwhile, creates the
  file, and resumes; from then on the rank dies as above.
- `die_in_write`: rank 0 is SIGKILLed instead while it writes that checkpoint of its process
  (counted from 1, after the phase marker exists) to disk: in the middle of `state.pt`, on the
  background writer's thread when checkpoints are asynchronous, once (`marker`).
- `throttle_in_write`: before the phase marker exists, rank 0's write of that checkpoint of its
  process (counted from 1) fails once in the middle of `state.pt` with the error a throttled
  object store raises (Ray Train retries an upload on its text).
"""

from __future__ import annotations

import collections
import glob
import os
import signal
import tempfile
import time

from torch import nn

from rayacc.models.mlp import MLP


class DiesOnce(nn.Module):
    def __init__(
        self,
        inner: nn.Module,
        marker: str,
        die_at_forward: int,
        die_rank: int = 1,
        kill: bool = False,
        phase_marker: str | None = None,
        hold_at_forward: int = 0,
        delay_s: float = 0.0,
    ):
        super().__init__()
        self.inner = inner
        self.marker = marker
        self.die_at_forward = die_at_forward
        self.die_rank, self.kill = die_rank, kill
        self.phase_marker, self.hold_at_forward = phase_marker, hold_at_forward
        self.delay_s = delay_s
        self.training_forwards = 0

    def forward(self, x):
        if self.training:
            self.training_forwards += 1
            time.sleep(self.delay_s)
            import ray.train

            ctx = ray.train.get_context()
            rank, world = ctx.get_world_rank(), ctx.get_world_size()
            first_phase = self.phase_marker is not None and not os.path.exists(self.phase_marker)
            if first_phase:
                if rank == 0 and self.training_forwards == self.hold_at_forward:
                    deadline = time.monotonic() + 120
                    while not os.path.exists(self.phase_marker) and time.monotonic() < deadline:
                        time.sleep(0.1)
            elif (
                self.training_forwards == self.die_at_forward
                and rank == self.die_rank % world
                and not os.path.exists(self.marker)
            ):
                open(self.marker, "w").close()
                if self.kill:
                    os.kill(os.getpid(), signal.SIGKILL)
                os._exit(1)
        return self.inner(x)


class _DiesWhenWritten:
    """The model's extra state: pickled in the middle of the checkpoint's `state.pt`, where it
    kills the process on cue; otherwise it is saved as an empty mapping (a type a weights-only
    load accepts)."""

    def __init__(self, die: str | None, throttle: str | None = None):
        self.die, self.throttle = die, throttle
        """`die`: the marker, beside which the staging left behind is listed (`.staging`);
        `throttle`: the file that says a put was throttled."""

    def __deepcopy__(self, memo):
        return self

    def __reduce_ex__(self, protocol):
        if self.throttle:
            open(self.throttle, "w").close()
            self.throttle = None  # once: the retry pickles this same object
            raise OSError(THROTTLE)
        if self.die:
            # the staging folders this process leaves behind: the next group must remove them
            from rayacc.checkpoint.upload import STAGING_PREFIX

            mine = glob.glob(f"{tempfile.gettempdir()}/{STAGING_PREFIX}*-{os.getpid()}-*")
            with open(f"{self.die}.staging", "w") as f:
                f.write("\n".join(mine))
            time.sleep(0.5)  # the next window is under way: the write is the background's
            os.kill(os.getpid(), signal.SIGKILL)
        return (collections.OrderedDict, ())


THROTTLE = "AWS Error SLOW_DOWN during PutObject operation: Please reduce your request rate."


class DiesInWrite(DiesOnce):
    def __init__(self, *args, die_in_write: int, throttle_in_write: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.die_in_write, self.throttle_in_write = die_in_write, throttle_in_write
        self.writes = self.first_phase_writes = 0

    def get_extra_state(self):
        import ray.train

        if self.phase_marker is not None and not os.path.exists(self.phase_marker):
            self.first_phase_writes += 1
            throttle = (
                self.first_phase_writes == self.throttle_in_write
                and ray.train.get_context().get_world_rank() == 0
            )
            return _DiesWhenWritten(None, f"{self.marker}.throttled" if throttle else None)
        self.writes += 1
        die = (
            self.writes == self.die_in_write
            and not os.path.exists(self.marker)
            and ray.train.get_context().get_world_rank() == 0
        )
        if die:
            open(self.marker, "w").close()
        return _DiesWhenWritten(self.marker if die else None)

    def set_extra_state(self, state):
        pass


def build(
    dataset,
    marker: str,
    die_at_forward: int,
    hidden: int = 32,
    dropout: float = 0.0,
    **options,
) -> nn.Module:
    cls = DiesInWrite if "die_in_write" in options else DiesOnce
    return cls(
        MLP(dataset.num_features, dataset.num_classes, [hidden], dropout),
        marker,
        die_at_forward,
        **options,
    )
