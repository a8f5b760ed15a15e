"""A resume continues the run as it was started: the job file with the overrides the run was
started with (recorded in its folder), and over them only the overrides given now — each one
that changes a started value said. A finished run's resume ends at once, saying so."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rayacc.redact import MASK, redact

__all__ = ["ResumedOverrides", "continued_run", "override_key", "resumed_overrides"]

RECORDED = "overrides"
"""The run info's key for the overrides the run was started with."""


def override_key(override: str) -> str:
    return override.split("=", 1)[0].strip()


@dataclass
class ResumedOverrides:
    """The overrides a resume runs with, and what it should say of them."""

    overrides: list[str]
    kept: list[str] = field(default_factory=list)
    """Started with, not given now: applied again."""
    changed: list[str] = field(default_factory=list)
    """Started with one value, given another now: `key: was → now`."""
    dropped: list[str] = field(default_factory=list)
    """Started with, but not recorded whole (a credential is masked): given again or not at
    all."""

    def lines(self) -> list[str]:
        out = []
        if self.kept:
            out.append("kept from the run's start: " + ", ".join(self.kept))
        out += [f"changed on resume: {line}" for line in self.changed]
        out += [
            f"not applied again (it carried a credential, recorded masked): {key}; give it "
            "again to keep it"
            for key in self.dropped
        ]
        return out


def resumed_overrides(started: Sequence[str], now: Sequence[str]) -> ResumedOverrides:
    """The started overrides, each replaced by one given now for the same key."""
    given = {override_key(o): o for o in now}
    out = ResumedOverrides([])
    for o in started:
        key = override_key(o)
        if MASK in o:
            if key not in given:
                out.dropped.append(key)
            continue
        if key in given:
            if given[key] != o:
                was, is_ = o.split("=", 1)[-1], given[key].split("=", 1)[-1]
                out.changed.append(f"{key}: {was} → {is_}")
            continue
        out.overrides.append(o)
        out.kept.append(o)
    out.overrides += list(now)
    return out


def continued_run(recorded: dict[str, Any], tracking_uri: str | None) -> tuple[str | None, str]:
    """(the MLflow run a resume reopens, or None; what a new run continues, or ''). The run
    recorded in the run's folder is reopened in the store it lives in; a resume that names
    another store starts a run there, tagged with the one it continues (that run's id means
    nothing in another store). The recorded store is masked, as the folder keeps it."""
    previous = recorded.get("mlflow_run_id")
    was = recorded.get("tracking_uri")
    if previous is None or was is None:
        return previous, ""
    from rayacc.tracking.mlflow_sink import default_tracking_uri

    now = redact(tracking_uri or default_tracking_uri())
    if now == was:
        return previous, ""
    return None, f"{previous} of {was}"
