"""The sweep schema: a base training config and the settings to try."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from rayacc.config.errors import MISSING, ConfigError, ConfigIssue, issues_from_validation
from rayacc.config.loader import read_yaml
from rayacc.config.schema import Section, TrainConfig

__all__ = ["RandomSearch", "SweepConfig"]


class RandomSearch(Section):
    samples: int = Field(0, ge=0)
    """Random trials drawn in addition to the grid."""
    seed: int = 0
    """Seeds the draws."""
    space: dict[str, dict[str, list[Any]]] = Field(default_factory=dict)
    """Key path → one distribution: {choice: [..]}, {uniform: [lo, hi]}, {loguniform: [lo, hi]}
    or {randint: [lo, hi]} (hi exclusive)."""


class SweepConfig(Section):
    """A sweep: a base training config and the settings to try."""

    name: str | None = None
    """The parent MLflow run's name; null = generated."""
    base: str | None = None
    """Path of the base training config (relative to the sweep file), or null with `config:`."""
    config: dict[str, Any] | None = None
    """The base training config inline (instead of `base`)."""
    overrides: list[str] = Field(default_factory=list)
    """key.path=value overrides applied to the base before the trials' own settings."""
    hold: Literal["global_batch_size"] | None = "global_batch_size"
    """`global_batch_size`: every trial keeps the base global batch; accumulation is derived.
    null: trials may change the global batch."""
    grid: dict[str, list[Any]] = Field(default_factory=dict)
    """Key path → values; every combination is a trial."""
    random: RandomSearch = Field(default_factory=RandomSearch)
    max_concurrent_trials: int | None = Field(None, ge=1)
    """Trials at once; null = as many as the cluster's CPUs (or GPUs) fit."""

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> tuple[SweepConfig, dict[str, Any], str]:
        """(sweep, base config as a dict with overrides applied, source label)."""
        raw = read_yaml(path, "sweep", "jobs/sweep_accum.yaml") or {}
        p = Path(path)
        try:
            sweep = cls.model_validate(raw)
        except ValidationError as exc:
            raise ConfigError(issues_from_validation(exc, cls), str(p)) from None
        if (sweep.base is None) == (sweep.config is None):
            raise ConfigError(
                [
                    ConfigIssue(
                        "base",
                        "give exactly one of `base` (a file) and `config` (inline)",
                        MISSING,
                        "e.g. base: digits.yaml",
                    )
                ],
                str(p),
            )
        if sweep.base is not None:
            base_path = (p.parent / sweep.base).resolve()
            base = TrainConfig.from_yaml(base_path, sweep.overrides)
        else:
            base = TrainConfig.from_dict(sweep.config or {}, sweep.overrides, source=str(p))
        return sweep, base.model_dump(mode="json"), str(p)
