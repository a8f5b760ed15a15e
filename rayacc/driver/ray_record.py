"""Ray Train's own record of a run's checkpoints (`checkpoint_manager_snapshot.json` in the run's
folder), kept in step with rayacc's catalogue. Ray Train reads it when a fit of the same run
starts and refuses to start when it names a folder that is not there
(`CheckpointManagerInitializationError`); rayacc's catalogue reads the folders themselves. Before
a fit, a folder the record names that is gone is dropped from the record and said, so the two
bookkeepers of one run never disagree and the run goes on from its newest whole checkpoint."""

from __future__ import annotations

import json
from typing import Any

from rayacc.checkpoint.storage import Storage

__all__ = ["RECORD_FILE", "reconcile_record", "retain"]

RECORD_FILE = "checkpoint_manager_snapshot.json"
"""Ray Train's name for it (`ray.train.v2._internal.constants`)."""


def _name(result: Any) -> str | None:
    name = result.get("checkpoint_dir_name") if isinstance(result, dict) else None
    return name if isinstance(name, str) else None


def reconcile_record(run: Storage) -> list[str]:
    """Drops from Ray Train's record of the run `run` every checkpoint whose folder is not
    there; returns what it said (empty when the record agrees, or there is none). A record that
    is not the JSON Ray writes is set aside (renamed), as Ray would refuse to start on it."""
    text = run.read(RECORD_FILE)
    if text is None:
        return []
    try:
        record = json.loads(text)
        results = list(record["checkpoint_results"])
        indices = list(record["checkpoint_report_indices"])
        if len(results) != len(indices):
            raise ValueError("results and indices differ in number")
    except (ValueError, KeyError, TypeError) as exc:
        run.put(f"{RECORD_FILE}.unreadable", text)
        run.delete(RECORD_FILE)
        return [
            f"Ray Train's record of the run's checkpoints ({run.uri(RECORD_FILE)}) is not the "
            f"JSON Ray writes ({type(exc).__name__}): set aside as {RECORD_FILE}.unreadable; "
            "the run goes on from its newest whole checkpoint"
        ]

    def there(result: Any) -> bool:
        name = _name(result)
        try:
            entry = run.stat(name) if name else None
        except ValueError:  # a name that climbs out of the run's folder
            entry = None
        return entry is not None and entry.kind == "dir"

    gone = [_name(r) or repr(r)[:80] for r in results if not there(r)]
    pending = list(record.get("pending_training_results") or [])
    specs = list(record.get("pending_validation_specs") or [])
    gone += [_name(r) or repr(r)[:80] for r in pending if not there(r) and _name(r) not in gone]
    if not gone:
        return []
    kept = [(r, i) for r, i in zip(results, indices, strict=True) if there(r)]
    record["checkpoint_results"] = [r for r, _ in kept]
    record["checkpoint_report_indices"] = [i for _, i in kept]
    if len(pending) == len(specs):
        both = [(r, s) for r, s in zip(pending, specs, strict=True) if there(r)]
        record["pending_training_results"] = [r for r, _ in both]
        record["pending_validation_specs"] = [s for _, s in both]
    if not there(record.get("latest_checkpoint_result")):
        record["latest_checkpoint_result"] = kept[-1][0] if kept else None
    for key in (
        "validated_checkpoint_dir_names",
        "timed_out_validation_checkpoint_dir_names",
        "failed_validation_checkpoint_dir_names",
    ):
        if isinstance(record.get(key), list):
            record[key] = [n for n in record[key] if n not in gone]
    run.put(RECORD_FILE, json.dumps(record).encode())
    return [
        f"Ray Train's record of the run named {name}, which is not there: dropped from the "
        "record; the run goes on from its newest whole checkpoint"
        for name in gone
    ]


def retain(storage: str, name: str, keep: int) -> list[str]:
    """The run's retention once a fit ends (`RunCheckpoints.prune`: the `keep` newest good
    checkpoints), and Ray Train's record of it brought in step with what is left; returns the
    folders deleted."""
    from rayacc.checkpoint.catalogue import RunCheckpoints
    from rayacc.checkpoint.storage import open_storage

    deleted = RunCheckpoints(storage, name).prune(keep)
    # the ranks pruned as they went too: every folder the record names that is gone leaves it
    reconcile_record(open_storage(storage).child(name))
    return deleted
