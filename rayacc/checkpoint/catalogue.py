"""The catalogue of a run's checkpoints on its storage: which folders are checkpoints, which
are whole, the latest whole one, and the run's lineage (its step records) read from them.

No listing raises because of one folder: a checkpoint that is not whole or not readable is
passed over and said once (`skipped`), whatever is wrong with it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayacc.checkpoint.format import HISTORY_FILE, META_FILE, attempt_of, folder_name, step_of
from rayacc.checkpoint.reader import (
    EARLIER,
    PASSED_OVER_FILE,
    CheckpointError,
    malformed_message,
    manifests,
    not_whole,
    parse_json,
    read_file,
    read_meta,
    whole_problems,
)
from rayacc.checkpoint.storage import Storage, open_storage

__all__ = ["Checkpoint", "RunCheckpoints"]


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint folder of a run, on any storage the seam reaches."""

    storage: Storage
    """The checkpoint's folder."""
    step: int
    attempt: int = 1
    """Which attempt at the step wrote it (`format.folder_name`)."""

    @property
    def uri(self) -> str:
        return self.storage.uri()

    @property
    def name(self) -> str:
        return folder_name(self.step, self.attempt)

    def meta(self) -> dict[str, Any]:
        return read_meta(self.storage)

    def missing(self) -> list[str]:
        """The files its manifests list that are not there as listed (empty: whole)."""
        return whole_problems(self.storage, self.meta())

    def good(self) -> bool:
        """Whole and not passed over by a restore (one a resume may take); a folder that
        cannot be read is not."""
        try:
            return not self.missing()
        except (CheckpointError, OSError):
            return False

    def history(self, through: int | None = None) -> list[dict[str, Any]]:
        """The lineage's step records up to this checkpoint's step (or `through`), in order;
        empty for a checkpoint written before checkpoints carried it. Its digest is checked
        when the manifest lists one."""
        source = self.storage.uri(HISTORY_FILE)
        text = read_file(self.storage, HISTORY_FILE) or b""
        files, _ = manifests(self.storage, self.meta())
        digest = files.get(HISTORY_FILE, (0, None))[1]
        if digest is not None:
            import hashlib

            if hashlib.sha256(text).hexdigest() != digest:
                raise CheckpointError(
                    not_whole(self.uri, [f"{HISTORY_FILE} (its content changed)"])
                    + ". Fix: use an earlier checkpoint_* folder of the run"
                )
        records = parse_json(text, source, lines=True)
        if not all(isinstance(r, dict) and type(r.get("step")) is int for r in records):
            raise CheckpointError(malformed_message(source, "step"))
        last = self.step if through is None else min(through, self.step)
        return [r for r in records if r["step"] <= last]

    def fetch(self, into: Path) -> Path:
        """The checkpoint as a local folder: itself on a local disk, else a copy in `into` of
        every file it lists (links and other things are not copied, so the reader refuses;
        nothing unlisted is copied, so it is refused here, as the folder's look refuses it)."""
        if "://" not in self.uri:
            return Path(self.uri)  # the reader checks it whole (`manifest.verify`)
        problems = self.missing()
        if problems:
            raise CheckpointError(f"{not_whole(self.uri, problems)}. {EARLIER}")
        files, _ = manifests(self.storage, self.meta())
        for name in [META_FILE, *self.meta().get("parts", []), *files]:
            data = self.storage.read(name)
            if data is None:
                continue
            target = into / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        return into


class RunCheckpoints:
    """The checkpoints of the run `storage/name`: the folders with a meta.json in step order,
    the latest whole one, the lineage."""

    def __init__(self, storage: str, name: str):
        self.run = open_storage(storage).child(name)
        self.skipped: list[str] = []
        """Checkpoints `latest` or `lineage` passed over, each said once."""

    folder_name = staticmethod(folder_name)
    step_of = staticmethod(step_of)

    def list(self) -> list[Checkpoint]:
        """The run's checkpoint folders with a meta.json, oldest first (whether each is whole
        is `Checkpoint.missing`: `latest` and `lineage` ask it, newest first)."""
        found = []
        try:
            entries = self.run.list()
        except OSError as exc:
            self._say(f"{self.run.uri()} could not be listed ({type(exc).__name__}: {exc})")
            return []
        for entry in entries:
            step = step_of(entry.name)
            if entry.kind != "dir" or step is None:
                continue
            folder = self.run.child(entry.name)
            if folder.stat(META_FILE) is not None:
                found.append(Checkpoint(folder, step, attempt_of(entry.name)))
        return sorted(found, key=lambda c: (c.step, c.attempt))

    def latest(self) -> Checkpoint | None:
        """The newest whole checkpoint; newer ones not whole or not readable are passed over
        and said in `skipped`."""
        return self._first_whole(reversed(self.list()))

    def lineage(self, step: int) -> list[dict[str, Any]]:
        """The step records 1..`step` of the run's lineage: from the checkpoint at `step`, or
        a later one of the same lineage when that one was pruned meanwhile (or is not
        whole)."""
        if step <= 0:
            return []
        for checkpoint in self._whole(c for c in self.list() if c.step >= step):
            try:
                return checkpoint.history(through=step)
            except (CheckpointError, OSError) as exc:
                self._say(str(exc))
        return []

    def load_latest(
        self,
        scratch: Path,
        map_location: Any = "cpu",
        at_most: int | None = None,
        excluding: Iterable[str] = (),
    ) -> tuple[Checkpoint, Path, tuple[dict, dict, dict]] | None:
        """The newest checkpoint that reads (whole, every digest as listed, its state plain
        data, its strategy's files vetted), not named in `excluding`; its view (under
        `scratch`: its manifests' files only, what the strategy's loader is handed) and what
        `read_checkpoint` returns; newer ones refused are passed over and said."""
        excluded = set(excluding)
        candidates = [
            c
            for c in self.list()
            if (at_most is None or c.step <= at_most) and c.name not in excluded
        ]
        for checkpoint in self._whole(reversed(candidates)):
            try:
                return checkpoint, *self.read(checkpoint, scratch, map_location)
            except (CheckpointError, OSError) as exc:
                self._say(str(exc))
        return None

    def refused(self) -> list[tuple[str, str]]:
        """(uri, why) of each checkpoint folder a restore passed over because it did not load
        (marked with `PASSED_OVER_FILE`), oldest first."""
        out = []
        for checkpoint in self.list():
            try:
                data = checkpoint.storage.read(PASSED_OVER_FILE)
            except OSError:
                continue
            if data is None:
                continue
            try:
                why = str(json.loads(data).get("reason"))[:300]
            except (ValueError, AttributeError):
                why = "its mark is unreadable"
            out.append((checkpoint.uri, why))
        return out

    def prune(self, keep: int) -> list[str]:
        """Retention (`run.keep_checkpoints`): the `keep` newest good checkpoints (whole, not
        passed over) stay, with every folder after the oldest of them (passed over or not
        whole: evidence, or a write in flight); every folder before it is deleted. Only good
        ones count, so a passed-over folder never costs a good one. Returns the deleted
        folders' names."""
        if keep < 1:
            return []
        listed = self.list()
        good = [c for c in listed if c.good()]
        if len(good) <= keep:
            return []
        oldest = good[-keep]
        gone = [c for c in listed if (c.step, c.attempt) < (oldest.step, oldest.attempt)]
        deleted = []
        for checkpoint in gone:
            try:
                self.run.delete(checkpoint.name)
                deleted.append(checkpoint.name)
            except OSError as exc:  # left for the next time: a storage fault costs no run
                self._say(f"{checkpoint.uri} could not be deleted ({type(exc).__name__})")
        return deleted

    def named(self, name: str) -> Checkpoint | None:
        """The checkpoint folder `name` of the run (with a meta.json), or None."""
        return next((c for c in self.list() if c.name == name), None)

    @staticmethod
    def read(
        checkpoint: Checkpoint, scratch: Path, map_location: Any = "cpu"
    ) -> tuple[Path, tuple[dict, dict, dict]]:
        """One checkpoint's view under `scratch` and what `read_checkpoint` returns (raises
        CheckpointError or OSError)."""
        from rayacc.checkpoint.reader import read_checkpoint

        local = checkpoint.fetch(scratch / f"{checkpoint.name}.copy")
        view = scratch / checkpoint.name
        if view.exists():
            import shutil

            shutil.rmtree(view)
        return view, read_checkpoint(local, map_location, into=view)

    def _first_whole(self, checkpoints: Iterable[Checkpoint]) -> Checkpoint | None:
        return next(self._whole(checkpoints), None)

    def _whole(self, checkpoints: Iterable[Checkpoint]):
        for checkpoint in checkpoints:
            try:
                missing = checkpoint.missing()
            except (CheckpointError, OSError) as exc:
                said = str(exc)
                self._say(said if checkpoint.uri in said else f"{checkpoint.uri}: {said}")
                continue
            if missing:
                self._say(not_whole(checkpoint.uri, missing))
                continue
            yield checkpoint

    def _say(self, note: str) -> None:
        if note not in self.skipped:
            self.skipped.append(note)
