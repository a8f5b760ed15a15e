from __future__ import annotations

import os
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from tests.support import LEAN_RAY_TRAIN, ROOT
from tests.support.services.counts import (
    COUNTS_ENV,
    KINDS,
    NOTES_ENV,
    counted_since,
    note,
    ray_sessions,
    read_notes,
    read_starts,
)

FOLDER_ENV = "RAYACC_TEST_FOLDER"

EQUIVALENCE = "equivalence: relative error of the update vs full batch"
_SECONDS_PER_FILE: Counter = Counter()

KIND_OF_FOLDER = {
    "unit": None,
    "distributed": "distributed",
    "ray": "ray",
    "cluster": "cluster",
}
"""tests/<folder>/: the marker every test there carries (`-m ray`, `-m "not cluster"`)."""

BUDGET = {"worker groups": 61, "Ray instances": 4, "clusters": 3, "MLflow servers": 4}
"""The most of each start the whole suite may make (tests/README.md: what each costs). 61
groups: 60 since the pass-over scenario (`ray/test_lineage.py`: a torn sharded checkpoint, then
three resumes at changing worker counts, four starts no other run could host), and the chat
job's run as a user runs it (`ray/test_finetune.py`); the plan search measures its top
candidate only, so it starts 6 groups whatever its measured profile ranks first
(bench/results/suite.md)."""


def pytest_configure(config):
    # Every process the suite starts — Ray's workers, `rayacc` subprocesses, local clusters —
    # inherits these: test-only model factories import from tests/, and each start is counted.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    # The run's own folder (a short path: Ray's Unix sockets live under it): its notes, and
    # per test process (this one, or each worker of a parallel run) the starts counted and the
    # session folders of the local Rays it starts, apart from any other Ray on the machine.
    if not hasattr(config, "workerinput"):
        # DeepSpeed's op, built once per machine where a run builds it (the user's rayacc
        # cache), not once per test session's temporary cache (about 30 s of 2 cores each)
        from rayacc.env import cache_dir

        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(cache_dir() / "torch_extensions"))
        folder = tempfile.mkdtemp(prefix="rt", dir="/tmp")
        os.environ[FOLDER_ENV] = folder
        os.environ[NOTES_ENV] = str(Path(folder) / "notes")
        os.environ["RAY_TRAIN_CALLBACKS"] = "tests.support.services.group_counter.CountWorkerGroups"
    # MLflow's own variables choose the store of a run whose config says null: one set in
    # the shell that runs the suite would send the tests' runs there
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        os.environ.pop(name, None)
    me = Path(os.environ[FOLDER_ENV]) / getattr(config, "workerinput", {}).get("workerid", "main")
    me.mkdir(exist_ok=True)
    os.environ[COUNTS_ENV] = str(me / "starts")
    os.environ["RAY_TMPDIR"] = str(me)


SECOND_WORKER = (
    "tests/cluster/",
    "tests/distributed/",
    "tests/unit/",
    "tests/ray/test_user_console.py",
    "tests/ray/test_local_ray.py",
    "tests/ray/test_finetune.py",
)
"""What the second worker of a parallel run takes (`-n 2 --dist loadgroup`, what
`scripts/test.sh` runs): the multi-node tests, which mostly wait on their clusters, the gloo
ranks, the units and the `rayacc` processes that start a Ray of their own; the first worker
takes every test on the suite's local Ray (`ray_local`, started once). A second `ray_local` on
the other worker (to even the two out) kept a Ray busy beside the clusters, whose node starts
then ran past their limits on 2 cores (tests/README.md)."""


def worker_group(nodeid: str) -> str:
    return "second" if nodeid.split("::")[0].startswith(SECOND_WORKER) else "first"


def pytest_itemcollected(item):
    if "ray_local" in item.fixturenames and worker_group(item.nodeid) != "first":
        raise pytest.UsageError(
            f"{item.nodeid} uses the suite's Ray on the worker that runs the clusters: keep it "
            "out of tests/conftest.py::SECOND_WORKER"
        )


def pytest_xdist_make_scheduler(config, log):
    # xdist's own groups (the `xdist_group` mark) do not reach its scheduler under pytest 9
    # (a node id is no longer a string it can suffix): the same grouping, by path
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkerGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    return ByWorkerGroup(config, log) if config.getvalue("dist") == "loadgroup" else None


def pytest_collection_modifyitems(items):
    for item in items:
        marker = KIND_OF_FOLDER.get(Path(str(item.path)).relative_to(ROOT / "tests").parts[0])
        if marker:
            item.add_marker(marker)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """What arrived in this process's counts while the test ran is the test's (its set-up
    included: a shared fixture's start counts for the first test that needs it)."""
    _, offset = counted_since(0)
    before = ray_sessions()
    try:
        return (yield)
    finally:
        starts, _ = counted_since(offset)
        starts += ["Ray instances"] * len(ray_sessions() - before)
        if starts:
            with open(Path(os.environ[COUNTS_ENV]).with_name("attributed"), "a") as f:
                f.writelines(f"{kind}\t{item.nodeid}\n" for kind in starts)


def pytest_runtest_logreport(report):
    # set-up, call and tear-down: a session fixture's start counts where it is first paid
    _SECONDS_PER_FILE[report.nodeid.split("::")[0]] += report.duration


@pytest.fixture
def record_equivalence():
    """Records an equivalence test's relative error for the end-of-run summary."""

    def record(name: str, err: float) -> None:
        note(EQUIVALENCE, f"{err:10.3e}  {name}")

    return record


def _totals() -> tuple[Counter, Counter]:
    counts = read_starts(os.environ[FOLDER_ENV])
    per_kind: Counter = Counter()
    for (kind, _), n in counts.items():
        per_kind[kind] += n
    return counts, per_kind


def pytest_terminal_summary(terminalreporter, config):
    for section, lines in read_notes(os.environ[NOTES_ENV]).items():
        terminalreporter.section(section)
        for line in lines:
            terminalreporter.write_line(line)
    if _SECONDS_PER_FILE:
        terminalreporter.section("seconds per file (set-up, call and tear-down)")
        for path, seconds in _SECONDS_PER_FILE.most_common():
            if seconds >= 1:
                terminalreporter.write_line(f"{seconds:8.1f}  {path}")
        terminalreporter.write_line(f"{sum(_SECONDS_PER_FILE.values()):8.1f}  all")
    counts, per_kind = _totals()
    if not per_kind:
        return
    terminalreporter.section("fixed costs: what the tests started")
    tests = sorted({test for _, test in counts})
    terminalreporter.write_line(" ".join(f"{k:>14}" for k in KINDS) + "  test")
    for test in tests:
        row = " ".join(f"{counts[kind, test] or '':>14}" for kind in KINDS)
        terminalreporter.write_line(f"{row}  {test}")
    terminalreporter.write_line(
        " ".join(f"{per_kind[k]:>14}" for k in KINDS)
        + "  all (budget: "
        + ", ".join(f"{k} {BUDGET[k]}" for k in KINDS)
        + ")"
    )
    over = [f"{k}: {per_kind[k]} > {BUDGET[k]}" for k in KINDS if per_kind[k] > BUDGET[k]]
    if over:
        terminalreporter.write_line("OVER BUDGET: " + "; ".join(over), red=True)


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):
        return
    _, per_kind = _totals()
    if any(per_kind[k] > BUDGET[k] for k in KINDS) and exitstatus == 0:
        # a start added without a thought costs every later run of the suite its time
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def ray_local(tmp_path_factory):
    """One real local Ray for the whole session (starting one costs seconds)."""
    import logging

    import ray

    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    # Ray Train's own Prometheus metrics and its drain watcher: callbacks and a helper actor in
    # every worker group (about 2 of its 20 CPU-seconds here), and nothing the tests on this Ray
    # prove uses them; the multi-node tests, which prove reclaims, run with Ray's defaults
    # (tests/cluster/conftest.py::cluster_env)
    os.environ[LEAN_RAY_TRAIN[0]] = os.environ[LEAN_RAY_TRAIN[1]] = "0"
    # as the `rayacc` command does: a finished group is noticed in 0.2 s instead of 2 s
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    os.environ["RAYACC_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    # "local" never joins a cluster left behind by an earlier crash
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=1024**3,
        logging_level=logging.WARNING,
        log_to_driver=False,
        _system_config={"prestart_worker_first_driver": False},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_address(ray_local):
    """The shared local Ray's address (`RAY_ADDRESS` for a `rayacc` process that joins it
    instead of starting a Ray of its own, which costs about 10 s of start and stop)."""
    import ray

    return ray.get_runtime_context().gcs_address


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """One real `mlflow server` for the session (a start costs about 20 s on 2 cores): its
    port. A test that needs the server gone puts a `tests.support.services.mlflow_server.Gate` in
    front of it and closes that; a test keeps to experiments of its own."""
    import signal

    from tests.support.services.mlflow_server import free_port, start_server

    port = free_port()
    proc = start_server(port, tmp_path_factory.mktemp("mlflow") / "server.db")
    yield port
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
