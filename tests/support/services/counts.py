"""What the suite starts, counted across every process it runs: the suite's time goes to these
fixed costs, so each is a number the suite keeps within a budget (tests/README.md).

- worker groups: Ray Train loads `group_counter.CountWorkerGroups` from `RAY_TRAIN_CALLBACKS`
  in every trainer any process of the suite builds (the `rayacc` command and Ray Tune's trials
  included) and calls it in the controller after each group starts: first starts, restarts and
  resizes alike.
- Ray instances: a new session folder under the test process's own Ray temp folder (`ray.init`
  or `rayacc` starting a local Ray; the clusters of cluster/local.sh keep theirs elsewhere and
  count as clusters).
- clusters (cluster/local.sh up / autoscale) and MLflow servers: counted by the helpers that
  start them.

Each start appends a line to the file `RAYACC_TEST_COUNTS` names, which every process a test
process starts inherits (one file per test process, so parallel workers do not mix); the test
process gives the lines that arrived while a test ran to that test.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

COUNTS_ENV = "RAYACC_TEST_COUNTS"
NOTES_ENV = "RAYACC_TEST_NOTES"
KINDS = ("worker groups", "Ray instances", "clusters", "MLflow servers")


def count(kind: str, path: str | None = None) -> None:
    """One start of `kind`; nothing when the suite is not counting (a script run by hand)."""
    path = path or os.environ.get(COUNTS_ENV)
    if path:
        # one short append: atomic between processes on a local file system
        with open(path, "a") as f:
            f.write(kind + "\n")


def counted_since(offset: int) -> tuple[list[str], int]:
    """The starts counted since `offset` (a position in this process's counts file), and
    the position now."""
    path = Path(os.environ.get(COUNTS_ENV, ""))
    if not path.is_file():
        return [], offset
    with open(path) as f:
        f.seek(offset)
        text = f.read()
        return text.splitlines(), f.tell()


def read_starts(folder: str | os.PathLike) -> Counter:
    """(kind, test) → starts, from every test process's `attributed` file under `folder`."""
    counts: Counter = Counter()
    for path in Path(folder).glob("*/attributed"):
        for line in path.read_text().splitlines():
            kind, _, test = line.partition("\t")
            counts[kind, test] += 1
    return counts


def ray_sessions() -> set[str]:
    """The session folders of the local Rays this test process's tests started (under its
    own RAY_TMPDIR, so another process's Ray does not count)."""
    folder = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray"
    return {p.name for p in folder.glob("session_2*")} if folder.is_dir() else set()


def note(section: str, line: str) -> None:
    """A line for the end-of-run summary's `section`, from any process of the suite (the
    summary is printed by the process that started it)."""
    path = os.environ.get(NOTES_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps([section, line]) + "\n")


def read_notes(path: str | os.PathLike) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    if Path(path).is_file():
        for raw in Path(path).read_text().splitlines():
            section, line = json.loads(raw)
            sections.setdefault(section, []).append(line)
    return sections
