"""What the suite starts, counted across every process it runs: the suite's time goes to these
fixed costs, so each is a number the suite keeps within a budget (tests/README.md).

- worker groups: Ray Train loads `group_counter.CountWorkerGroups` from `RAY_TRAIN_CALLBACKS`
  in every trainer any process of the suite builds (the `rayacc` command included) and calls
  it in the controller after each group starts: first starts, restarts and resizes alike.
- Ray instances: a new session folder under the suite's Ray temp folder (`ray.init` or
  `rayacc` starting a local Ray; the clusters of cluster/local.sh keep theirs elsewhere and
  count as clusters).
- clusters (cluster/local.sh up / autoscale) and MLflow servers: counted by the helpers that
  start them.

Each start appends one line `kind<TAB>test id` to a file every process reaches through
`RAYACC_TEST_COUNTS`; the test id is the one pytest exports while it runs a test, which the
processes a test starts inherit.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

COUNTS_ENV = "RAYACC_TEST_COUNTS"
KINDS = ("worker groups", "Ray instances", "clusters", "MLflow servers")


def current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0] or "(no test)"


def count(kind: str, test: str | None = None, path: str | None = None) -> None:
    """One start of `kind`; nothing when the suite is not counting (a script run by hand)."""
    path = path or os.environ.get(COUNTS_ENV)
    if path:
        # one short append: atomic between processes on a local file system
        with open(path, "a") as f:
            f.write(f"{kind}\t{test or current_test()}\n")


def read_counts(path: str | os.PathLike) -> Counter:
    """(kind, test) → starts."""
    counts: Counter = Counter()
    if Path(path).is_file():
        for line in Path(path).read_text().splitlines():
            kind, _, test = line.partition("\t")
            counts[kind, test] += 1
    return counts


def ray_sessions() -> set[str]:
    """The session folders of the local Rays started so far (under the suite's own
    RAY_TMPDIR, so another suite on the machine does not count)."""
    folder = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray"
    return {p.name for p in folder.glob("session_2*")} if folder.is_dir() else set()


NOTES_ENV = "RAYACC_TEST_NOTES"


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
