"""A resume continues the run as it was started: the job file with the overrides the run was
started with (recorded in its folder), and over them only the overrides given now — each one
that changes a started value said. A finished run's resume ends at once, saying so. The rule
is the driver's (`resume_config`), whatever the door: `rayacc train --resume`, `rayacc submit
--resume` (which runs it on the cluster) and `fit(cfg, resume=True)` for a config read from a
job file (`TrainConfig.from_yaml`: a config built in code is given whole, now)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rayacc.redact import MASK, redact

__all__ = [
    "ResumedOverrides",
    "continued_run",
    "override_key",
    "resume_config",
    "resumed_overrides",
    "run_to_fit",
    "started_overrides",
]

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


def started_overrides(job: str, given: Sequence[str]) -> list[str] | None:
    """The overrides the run that `job` with `given` names (`run.name`) was started with, read
    before the config is validated: the job with only what is given now may not stand alone
    (a key that needs the started run's strategy). None where the run is not named or has
    none recorded (an unnamed resume finds its run by the job's identity, once validated)."""
    from rayacc.config import TrainConfig
    from rayacc.config.loader import read_yaml
    from rayacc.config.overrides import apply_overrides
    from rayacc.data.common import DataError
    from rayacc.driver.runs import _run_info, default_storage

    try:
        raw = read_yaml(job, "config", "-c jobs/digits.yaml")
    except Exception:  # the validated load names the file's problem
        return None
    data = apply_overrides(raw if isinstance(raw, dict) else {}, list(given), [], TrainConfig)
    run = data.get("run") if isinstance(data, dict) else None
    name = run.get("name") if isinstance(run, dict) else None
    if not isinstance(name, str) or not name:
        return None
    storage = run.get("storage_path")
    try:
        info = _run_info(default_storage(storage if isinstance(storage, str) else None), name)
    except (DataError, OSError, ValueError):
        return None  # the resume's own checks name it
    recorded = info.get(RECORDED)
    if not isinstance(recorded, list) or not all(isinstance(o, str) for o in recorded):
        return None
    return recorded


def resume_config(job: str | None, given: Sequence[str], cfg=None, extra: Sequence[str] = ()):
    """(config, Prepared, ResumedOverrides or None) of a resume: the job file `job` with the
    overrides the run was started with and `given` over them (`extra`: overrides not
    recorded, a submitted job's credentials). `cfg`: the config of `job` with `given`, where
    the caller has it. Without a job file, `cfg` as it is. An unnamed resume finds its run by
    the job's identity, so that config is prepared first."""
    from rayacc.config import TrainConfig
    from rayacc.driver.prelaunch import prepare
    from rayacc.driver.runs import locate_run

    started = started_overrides(job, given) if job else None
    if started is not None:
        return _with_started(job, given, extra, started, cfg=cfg)
    if cfg is None:
        cfg = TrainConfig.from_yaml(job, [*given, *extra])
    prep = prepare(cfg)
    if job is not None:
        run = locate_run(prep.spec.cfg.run, True, prep.spec.identity)
        started = run.previous.get(RECORDED)
    if not started:
        return prep.spec.cfg, prep, None
    return _with_started(job, given, extra, started, prep=prep)


def run_to_fit(cfg, resume: bool, prepared=None, location=None, say=lambda line: None):
    """(Prepared, RunLocation) of a fit: as the caller found them, else the run `cfg` names,
    and on a resume the config it runs with (`resume_config`: the started run's overrides
    beneath `cfg`'s). `say`: each line the resume and the choice of the run have to tell."""
    from rayacc.driver.prelaunch import locate, prepare

    resumed = None
    if location is None and resume and prepared is None:
        cfg, prepared, resumed = resume_config(cfg.source_file, cfg.overrides, cfg)
    prep = prepared or prepare(cfg)
    if location is None:
        location = locate(prep.spec.cfg.run, resume, prep.spec.resume_terms)
        location.overrides = resumed.overrides if resumed else cfg.overrides
        for line in [*(resumed.lines() if resumed else []), *location.notes]:
            say(f"rayacc: {line}")
    return prep, location


def _with_started(job, given, extra, started, cfg=None, prep=None):
    """The resume's config from the started overrides: the one the caller has (`cfg`, or the
    one `prep` derived) when they add nothing, else the job read again with them."""
    from rayacc.config import TrainConfig
    from rayacc.driver.prelaunch import prepare

    resumed = resumed_overrides(started, given)
    if not (resumed.kept or resumed.dropped):
        if prep is not None:
            return prep.spec.cfg, prep, resumed
        if cfg is not None:
            return cfg, prepare(cfg), resumed
    merged = TrainConfig.from_yaml(job, [*resumed.overrides, *extra])
    return merged, prepare(merged), resumed


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
