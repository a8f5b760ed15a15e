from __future__ import annotations

import pytest

_EQUIVALENCE: list[tuple[str, float]] = []


@pytest.fixture
def record_equivalence():
    """Records an equivalence test's relative error for the end-of-run summary."""

    def record(name: str, err: float) -> None:
        _EQUIVALENCE.append((name, err))

    return record


def pytest_terminal_summary(terminalreporter):
    if _EQUIVALENCE:
        terminalreporter.section("equivalence: relative error of the update vs full batch")
        for name, err in _EQUIVALENCE:
            terminalreporter.write_line(f"{err:10.3e}  {name}")


@pytest.fixture(scope="session")
def ray_local(tmp_path_factory):
    """One real local Ray for the whole session (starting one costs seconds)."""
    import logging
    import os
    from pathlib import Path

    import ray

    root = str(Path(__file__).resolve().parent.parent)
    # Ray workers inherit the environment: test-only model factories import from tests/
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
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
