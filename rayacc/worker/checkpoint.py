"""When a rank saves and restores the run's checkpoints, through Ray Train: every rank reports
(a barrier), each rank with a part stages it and puts it into storage through the checkpoint
layer's upload (`rayacc/checkpoint/upload.py`), which Ray Train calls as the report's upload
function (in the background for `train.checkpoint_mode: async`). A restarted group restores the
newest checkpoint that reads (`rayacc/checkpoint/catalogue.py`), the one every rank agrees on.
What a checkpoint is on storage is the checkpoint layer's (`rayacc/checkpoint/format.py`)."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rayacc.checkpoint.catalogue import RunCheckpoints
from rayacc.checkpoint.format import (
    HISTORY_FILE,
    folder_name,
    write_checkpoint,
    write_part,
)
from rayacc.checkpoint.lease import check_lease
from rayacc.checkpoint.lineage import StepLog
from rayacc.checkpoint.reader import PASSED_OVER_FILE, CheckpointError
from rayacc.checkpoint.storage import open_storage
from rayacc.checkpoint.upload import PartUpload, staging_folder, sweep_stale_staging
from rayacc.engine.random_state import RandomStreams
from rayacc.redact import redact

__all__ = ["Checkpointer", "NoCheckpointLoads", "WorkerParts", "raised_by_ranks"]


class NoCheckpointLoads(CheckpointError):
    """Every checkpoint of the run a restore could use was refused (not one of its parts
    loads): the run ends with each folder and why, instead of training from the beginning
    (or failing the same way at every restart)."""


def raised_by_ranks(
    exc: BaseException, kinds: tuple[type[BaseException], ...]
) -> BaseException | None:
    """An error of `kind` a rank raised inside a failed fit (Ray Train's WorkerGroupError holds
    each rank's error, a task error wrapping it): a user's error on the driver (exit 2), not a
    training failure."""
    seen: list[BaseException] = [exc, *getattr(exc, "worker_failures", {}).values()]
    while seen:
        e = seen.pop()
        if isinstance(e, kinds):
            return e
        seen += [c for c in (getattr(e, "cause", None), e.__cause__) if c is not None]
    return None


class Checkpointer:
    """A rank's saves and restores of the run `storage/name`. `lease`: the token of the
    driver's lease on the run (a part is committed only while it is the run's: `check_lease`);
    None where no driver holds one."""

    def __init__(
        self,
        storage: str,
        name: str,
        parts: WorkerParts,
        lease: str | None = None,
        keep: int | None = None,
    ):
        self.storage, self.name, self.parts, self.lease = storage, name, parts, lease
        self.keep = keep
        """`run.keep_checkpoints`: rank 0 deletes older checkpoints once each is written
        (None: none deleted)."""
        self.run = open_storage(storage).child(name)
        self._in_flight: _InFlight | None = None
        self.passed_over: list[str] = []
        """Checkpoints the last restore chose and could not load, each with why."""
        self.complete_s: float | None = None
        """The seconds the latest complete checkpoint took, from the save to its files in
        storage (what a checkpoint the ranks must wait for costs)."""
        # staging folders of this node's processes that were killed mid-upload (a group torn
        # down): this group's start is the first moment anyone can remove them
        sweep_stale_staging()

    def _commit(self) -> None:
        if self.lease is not None:
            check_lease(self.storage, self.name, self.lease)

    # ------------------------------------------------------------------ restore
    def restore(self) -> dict[str, Any] | None:
        """Loads the newest checkpoint of the run that loads whole, if any, into the worker's
        parts and returns its meta. Rank 0 chooses it (passing over ones not whole or refused)
        and every rank loads the same one, from its view (`RunCheckpoints.read`): every part
        (model and optimizer state, schedule, scaler, train state, random state, lineage),
        checked before any is loaded and loaded before the run commits to it. One that any
        rank cannot read or load is passed over to the newest before it, on every rank, and
        marked in storage (`PASSED_OVER_FILE`), so no later group meets the same failure;
        `passed_over` says each. Where checkpoints were refused (now or by an earlier group)
        and none loads, NoCheckpointLoads names each: the run does not start over silently."""
        from rayacc.engine import all_gather_objects

        self._commit()  # a group of a driver that lost its run does not start training
        w = self.parts
        refused: list[str] = []
        with tempfile.TemporaryDirectory(prefix="rayacc-restore-") as scratch:
            checkpoints = RunCheckpoints(self.storage, self.name)
            while True:
                found = None
                if w.rank == 0:
                    found = checkpoints.load_latest(
                        Path(scratch), map_location=w.device, excluding=refused
                    )
                name = all_gather_objects(found[0].name if found else None)[0]
                if name is None:
                    self._none_loads(checkpoints)
                    return None
                error = None
                try:
                    if found is None:
                        found = self._read_named(checkpoints, name, Path(scratch))
                    _, view, (saved, _, meta) = found
                    w.check(saved, meta)
                except CheckpointError as exc:
                    error = str(exc)
                except OSError:
                    raise  # the storage or the disk, not the checkpoint: a restart tries again
                except Exception as exc:
                    error = f"{type(exc).__name__}: {str(exc)[:400]}"
                if self._pass_over(name, all_gather_objects(error), refused):
                    continue
                try:
                    w.load(view, saved, meta)
                except OSError:
                    raise
                except Exception as exc:
                    error = f"{type(exc).__name__}: {str(exc)[:400]}"
                if self._pass_over(name, all_gather_objects(error), refused):
                    # what it loaded is overwritten whole by the one that loads next
                    continue
                return meta

    def _none_loads(self, checkpoints: RunCheckpoints) -> None:
        """No checkpoint is left to load: raises NoCheckpointLoads where any was refused by a
        load (this restore's, or an earlier group's mark), naming each; else the run starts
        from the beginning (none was written, or only ones not whole: a write cut short)."""
        from rayacc.engine import all_gather_objects

        marked = checkpoints.refused() if self.parts.rank == 0 else []
        # rank 0 chose: what it passed over as not whole or unreadable (random bytes, a
        # digest that does not match) is said with the rest
        marked, skipped = all_gather_objects((marked, list(checkpoints.skipped)))[0]
        said = {n.split(" did not load", 1)[0] for n in self.passed_over}
        lines = [*self.passed_over]
        lines += [f"{uri} was passed over by an earlier restore ({why})" for uri, why in marked
                  if uri not in said]  # fmt: skip
        if not lines:
            return
        lines += [f"passed over: {note}" for note in skipped]
        raise NoCheckpointLoads(
            f"no checkpoint of run {self.run.uri()} loads:\n  "
            + "\n  ".join(redact(line) for line in lines)
            + "\nFix: resume with the rayacc and job that wrote them (the strategy, model and "
            "optimizer the reasons name), or start a new run (drop --resume, or another "
            "run.name); delete a folder's PASSED_OVER.json to have it tried again"
        )

    def _read_named(self, checkpoints: RunCheckpoints, name: str, scratch: Path):
        checkpoint = checkpoints.named(name)
        if checkpoint is None:
            raise CheckpointError(f"{self.run.uri(name)} is not there on rank {self.parts.rank}")
        # an OSError (the storage, not the checkpoint) ends the group: a restart tries again
        return (checkpoint, *checkpoints.read(checkpoint, scratch, self.parts.device))

    def _pass_over(self, name: str, errors: list[str | None], refused: list[str]) -> bool:
        """Whether any rank's error passes the checkpoint `name` over (every rank sees every
        rank's): then it is said, and rank 0 marks it in storage."""
        said = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
        if not said:
            return False
        refused.append(name)
        reason = "; ".join(said)[:1500]
        self.passed_over.append(f"{self.run.uri(name)} did not load ({redact(reason)})")
        if self.parts.rank == 0:
            self._commit()
            self.run.child(name).put(
                PASSED_OVER_FILE, json.dumps({"reason": redact(reason)}).encode()
            )
        return True

    # ------------------------------------------------------------------ save
    def save(
        self,
        metrics: dict[str, Any],
        *,
        step: int,
        description: dict,
        meta: dict,
        files: dict[str, str] | None = None,
        background: bool = False,
    ) -> float:
        """Every rank reports (a barrier). Rank 0 stages its part (the state, every rank's
        random state, the lineage); a strategy that shards has every rank stage its shards
        too; each part is put into the checkpoint's folder in storage, its manifest last.

        `background`: training waits only for the copy of the state (and, sharded, its
        staging); the files are written and put into storage on Ray Train's upload thread,
        and Ray Train registers the checkpoint only once that is done. At most one is in
        flight: a save first waits for the one before (`wait`). Returns the seconds of that
        wait."""
        import ray.train

        from rayacc.engine import all_gather_objects
        from rayacc.engine.parallel import host_copy

        waited = self.wait()
        w = self.parts
        started = time.perf_counter()
        # rank 0 names the folder (one no earlier attempt wrote into), said with the random state
        gathered = all_gather_objects(
            (w.streams.state(), self._fresh_folder(step) if w.rank == 0 else None)
        )
        rng = [r for r, _ in gathered]
        name = gathered[0][1]
        staging = staging_folder()
        has_part = w.rank == 0 or w.strategy.writes_shards
        try:
            whole, written = w.strategy.state.save(
                w.strategy.model, w.optimizer, staging, w.rank, background=background
            )
            state = None
            if w.rank == 0:
                stateful = {n: None if p is None else p.state_dict() for n, p in w.stateful.items()}
                state = {**whole, **(host_copy(stateful) if background else stateful), "rng": rng}
                if w.history is not None:
                    w.history.copy_to(staging / HISTORY_FILE)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

        def prepare() -> None:
            written()
            if state is not None:
                write_checkpoint(
                    staging, state=state, description=description, meta=meta, files=files
                )
            else:
                write_part(staging, rank=w.rank, step=step)

        upload = PartUpload(
            staging,
            self.run.child(name),
            rank=w.rank,
            step=step,
            prepare=prepare,
            commit=self._commit,
        )
        if not has_part:
            upload.discard()
            ray.train.report(metrics, checkpoint=None, checkpoint_dir_name=name)
            self.complete_s = time.perf_counter() - started
            return waited
        storage = ray.train.get_context().get_storage()
        flight = _InFlight(step, started)

        def put(_: ray.train.Checkpoint, dir_name: str) -> ray.train.Checkpoint:
            # Ray Train calls this again when the error's text reads as a store's throttle:
            # `run` then returns at once (done) or raises the same error (abandoned)
            try:
                upload.run()
            except BaseException as exc:
                flight.error = exc
                raise
            finally:
                flight.seconds = time.perf_counter() - started
                # known the moment the write ends, not at the next checkpoint's wait
                self.complete_s = flight.seconds
                flight.done.set()
            return ray.train.Checkpoint(
                storage.build_checkpoint_path_from_name(dir_name), storage.storage_filesystem
            )

        checkpoint = ray.train.Checkpoint.from_directory(staging)
        if not background:
            try:
                ray.train.report(
                    metrics,
                    checkpoint=checkpoint,
                    checkpoint_dir_name=name,
                    checkpoint_upload_fn=put,
                )
            finally:
                upload.discard()
            self.complete_s = time.perf_counter() - started
            self.prune()
            return waited
        self._in_flight = flight
        ray.train.report(
            metrics,
            checkpoint=checkpoint,
            checkpoint_dir_name=name,
            checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
            checkpoint_upload_fn=put,
        )
        return waited

    def prune(self) -> None:
        """Rank 0 applies the run's retention (`RunCheckpoints.prune`) once a checkpoint of its
        is in storage, while the run's lease is its driver's; a storage error leaves the folders
        for the next time."""
        if self.keep is None or self.parts.rank != 0:
            return
        try:
            self._commit()
            RunCheckpoints(self.storage, self.name).prune(self.keep)
        except OSError:
            pass

    def _fresh_folder(self, step: int) -> str:
        """The name of the checkpoint folder of `step` that nothing is in yet: a group that
        resumed from before a folder another group left (its checkpoint not whole, passed over,
        or written at another world size) writes the step again beside it, never into it."""
        attempt = 1
        while self.run.stat(folder_name(step, attempt)) is not None:
            attempt += 1
        return folder_name(step, attempt)

    def cost_s(self) -> float | None:
        """What a checkpoint costs on this rank, whole, as last measured: the last one's
        blocking part and completion; while one is in flight and slower than that, at least
        the time since it began. None before the first."""
        flight = self._in_flight
        running = None
        if flight is not None and not flight.done.is_set():
            running = time.perf_counter() - flight.started
        known = [s for s in (self.complete_s, running) if s is not None]
        return max(known) if known else None

    def wait(self) -> float:
        """Until the checkpoint in flight, if any, is in storage (its time: `complete_s`); one
        that could not be written ends the group (a restart resumes from the one before).
        Returns the seconds waited."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return 0.0
        t = time.perf_counter()
        flight.done.wait()
        waited = time.perf_counter() - t
        self.complete_s = flight.seconds
        if flight.error is not None:
            raise RuntimeError(
                f"the checkpoint of step {flight.step} could not be written "
                f"({type(flight.error).__name__}: {redact(str(flight.error))[:300]})"
            ) from flight.error
        self.prune()
        return waited


@dataclass
class _InFlight:
    """A checkpoint being written and put into storage in the background."""

    step: int
    started: float = 0.0
    """time.perf_counter() when the checkpoint began (its blocking part included)."""
    done: threading.Event = field(default_factory=threading.Event)
    seconds: float = 0.0
    error: BaseException | None = None


@dataclass
class WorkerParts:
    """What a worker's checkpoint saves and restores: the strategy's model and optimizer state
    (whole, or every rank's shards), the `stateful` parts by name (schedule, scaler, train
    state: anything with `state_dict` / `load_state_dict`), every rank's random stream, and on
    rank 0 the lineage (`history`)."""

    strategy: Any
    optimizer: torch.optim.Optimizer
    stateful: dict[str, Any]
    rank: int
    world: int
    device: torch.device
    streams: RandomStreams
    history: StepLog | None = None

    def check(self, saved: dict, meta: dict) -> None:
        """Raises unless every part of a read checkpoint is there in the form its loader
        takes, before anything is loaded."""
        for key, kind in (("optimizer_step", int), ("num_workers", int)):
            if type(meta.get(key)) is not kind:
                raise CheckpointError(f"its meta.json has no {key}")
        for name, part in self.stateful.items():
            if part is not None and not isinstance(saved.get(name, {}), dict):
                raise CheckpointError(f"its {name} state is not a state dict")
        RandomStreams.check(saved.get("rng"))

    def load(self, view: str | Path, saved: dict, meta: dict) -> None:
        """Every part of the checkpoint (read and checked), into this rank's state: a failure
        of any part is the checkpoint's, and the next one tried overwrites all of them."""
        self.strategy.state.load(
            self.strategy.model, self.optimizer, view, saved, meta["num_workers"]
        )
        for name, part in self.stateful.items():
            if part is not None and saved.get(name) is not None:
                part.load_state_dict(saved[name])
        self.streams.restore(saved.get("rng"), meta["optimizer_step"])
        if self.history is not None:
            self.history.load(Path(view) / HISTORY_FILE)
