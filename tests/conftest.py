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
