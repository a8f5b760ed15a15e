"""The sweep schema: a base training config and the settings to try."""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from rayacc.config.errors import MISSING, ConfigError, ConfigIssue, issues_from_validation
from rayacc.config.loader import read_yaml
from rayacc.config.schema import Section, TrainConfig
from rayacc.config.strings import CHECKED_ELSEWHERE, PLACE, string_issues

__all__ = ["DISTRIBUTIONS", "JUDGED_METRICS", "RandomSearch", "Scheduler", "Search", "SweepConfig"]

DISTRIBUTIONS = ("choice", "uniform", "loguniform", "randint")
JUDGED_METRICS = {
    "train/loss": "min",
    "train/grad_norm": "min",
    "train/samples_per_s": "max",
    "perf/step_time_s": "min",
    "val/loss": "min",
    "val/accuracy": "max",
}
"""The step metrics a scheduler can judge trials by, and the direction that is better (a
`val/` one at the validation steps only)."""


class RandomSearch(Section):
    samples: int = Field(0, ge=0)
    """Random trials drawn in addition to the grid."""
    seed: int = 0
    """Seeds the draws."""
    space: dict[str, dict[str, list[Any]]] = Field(default_factory=dict)
    """Key path → one distribution: {choice: [..]}, {uniform: [lo, hi]}, {loguniform: [lo, hi]}
    or {randint: [lo, hi]} (hi exclusive)."""


class Judged(Section):
    """What a scheduler or a search algorithm goes by; a bare name takes the defaults."""

    metric: str = "train/loss"
    """The step metric trials are judged by: one of train/loss, train/grad_norm,
    train/samples_per_s, perf/step_time_s, val/loss, val/accuracy."""
    mode: Literal["min", "max"] | None = None
    """Whether lower or higher is better; null = the metric's own (max for accuracy and
    samples/s)."""

    @model_validator(mode="before")
    @classmethod
    def _by_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    def judged_as(self) -> tuple[str, str]:
        """(metric, mode) with the mode derived where it was left out."""
        return self.metric, self.mode or JUDGED_METRICS.get(self.metric, "min")

    def issues(self, field: str) -> list[ConfigIssue]:
        if self.metric in JUDGED_METRICS:
            return []
        return [
            ConfigIssue(
                f"{field}.metric",
                "is not a step metric a trial reports (a trial would never be judged)",
                self.metric,
                "use one of " + ", ".join(JUDGED_METRICS),
            )
        ]


class Scheduler(Judged):
    """Ray Tune's trial scheduler, which stops trials that do worse than the others at the same
    step (`scheduler: asha` takes the defaults)."""

    name: Literal["asha", "median_stopping"]
    """`asha`: Tune's AsyncHyperBandScheduler (asynchronous successive halving, HyperBand's
    asynchronous form); `median_stopping`: Tune's MedianStoppingRule."""
    grace_period: int = Field(1, ge=1)
    """Optimizer steps every trial runs before it can be stopped."""
    reduction_factor: float | None = Field(None, gt=1)
    """asha: 1/r of the trials go on at each rung (null = Tune's 4); not for median_stopping."""

    def issues(self, field: str = "scheduler") -> list[ConfigIssue]:
        issues = super().issues(field)
        if self.name == "median_stopping" and self.reduction_factor is not None:
            issues.append(
                ConfigIssue(
                    "scheduler.reduction_factor",
                    "is asha's setting; median_stopping has no rungs to reduce",
                    self.reduction_factor,
                    "remove it, or use name: asha",
                )
            )
        return issues


SEARCH_PACKAGES = {"optuna": "optuna", "hyperopt": "hyperopt"}
"""Each search algorithm's package (Tune wraps it; rayacc's `tune` extra brings optuna)."""


class Search(Judged):
    """A Ray Tune search algorithm: it proposes `random.samples` trials from `random.space`,
    each after learning from the trials before (`search: optuna` takes the defaults)."""

    name: Literal["optuna", "hyperopt"]
    """`optuna`: Tune's OptunaSearch (TPE); `hyperopt`: Tune's HyperOptSearch."""

    def issues(self, field: str = "search") -> list[ConfigIssue]:
        import importlib.util

        issues = super().issues(field)
        package = SEARCH_PACKAGES[self.name]
        if importlib.util.find_spec(package) is None:
            issues.append(
                ConfigIssue(
                    "search.name",
                    f"{self.name} needs the {package} package, which is not installed",
                    self.name,
                    f"pip install {package}"
                    + (" (or rayacc[tune])" if package == "optuna" else ""),
                )
            )
        return issues


class SweepConfig(Section):
    """A sweep: a base training config and the settings to try."""

    name: str | None = None
    """The parent MLflow run's name; null = generated."""
    base: str | None = Field(None, json_schema_extra=PLACE)
    """Path of the base training config (relative to the sweep file), or null with `config:`."""
    config: dict[str, Any] | None = Field(None, json_schema_extra=CHECKED_ELSEWHERE)
    """The base training config inline (instead of `base`)."""
    overrides: list[str] = Field(default_factory=list, json_schema_extra=CHECKED_ELSEWHERE)
    """key.path=value overrides applied to the base before the trials' own settings."""
    hold: Literal["global_batch_size"] | None = "global_batch_size"
    """`global_batch_size`: every trial keeps the base global batch; accumulation is derived.
    null: trials may change the global batch."""
    grid: dict[str, list[Any]] = Field(default_factory=dict, json_schema_extra=CHECKED_ELSEWHERE)
    """Key path → values; every combination is a trial."""
    random: RandomSearch = Field(default_factory=RandomSearch, json_schema_extra=CHECKED_ELSEWHERE)
    plan: str | None = Field(None, json_schema_extra=PLACE)
    """A PLAN.yaml from `rayacc plan --search` (relative to the sweep file), for `from_plan`."""
    from_plan: int | None = Field(None, ge=1)
    """Run the plan's best N candidates as the trials (measured fastest first, then by the
    prior), at the plan's global batch; the report sets their predicted step time and memory
    beside what the trials measured. Instead of `grid` and `random`."""
    max_concurrent_trials: int | None = Field(None, ge=1)
    """Trials at once; null = as many as the cluster's CPUs (or GPUs) fit."""
    search: Search | None = None
    """Propose the trials with Ray Tune's search algorithm by name (`optuna`, `hyperopt`, or a
    section with `name:`, `metric:`, `mode:`): `random.samples` trials from `random.space`,
    seeded by `random.seed`, instead of drawing them up front; null = the grid and the random
    draws as listed."""
    scheduler: Scheduler | None = None
    """Stop trials early (Ray Tune's schedulers by name: `asha`, `median_stopping`, or a
    section with `name:` and its settings); null = every trial runs to its end. A stopped
    trial's group is torn down, its MLflow run ends KILLED with `rayacc.stopped_early`."""

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> tuple[SweepConfig, dict[str, Any], str]:
        """(sweep, base config as a dict with overrides applied, source label)."""
        raw = read_yaml(path, "sweep", "-c jobs/sweep_accum.yaml") or {}
        p = Path(path)
        # its secrets known by where they stand (a grid over `…hub_token`) before a record of
        # the sweep is written: the parent run's sweep.yaml, params and trials' names
        from rayacc.redact.origins import register_config

        register_config(raw if isinstance(raw, dict) else {})
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
        shape_issues = sweep.plan_issues() + sweep.trial_issues() + string_issues(sweep)
        shape_issues += sweep.judged_issues()
        if shape_issues:
            raise ConfigError(shape_issues, str(p))
        if sweep.plan is not None:
            sweep.plan = str((p.parent / sweep.plan).resolve())
        if sweep.base is not None:
            base_path = (p.parent / sweep.base).resolve()
            base = TrainConfig.from_yaml(base_path, sweep.overrides)
        else:
            base = TrainConfig.from_dict(sweep.config or {}, sweep.overrides, source=str(p))
        dumped = base.model_dump(mode="json")
        issues = sweep.setting_issues(dumped)
        if issues:
            raise ConfigError(issues, str(p))
        return sweep, dumped, str(p)

    def judged_issues(self) -> list[ConfigIssue]:
        """The scheduler's and the search's own, and what they ask of the rest: a search
        proposes from `random.space` alone, and both go by one metric."""
        issues = [i for part in (self.scheduler, self.search) if part for i in part.issues()]
        if self.search is not None and (self.grid or self.from_plan):
            issues.append(
                ConfigIssue(
                    "search",
                    f"{self.search.name} proposes every trial from random.space: a grid or a "
                    "plan's candidates beside it would not be searched",
                    self.search.name,
                    "move each grid key into random.space as {choice: [...]}, or remove search",
                )
            )
        if self.search and self.scheduler and self.search.judged_as() != self.scheduler.judged_as():
            issues.append(
                ConfigIssue(
                    "search.metric",
                    f"the search goes by {self.search.judged_as()} and the scheduler by "
                    f"{self.scheduler.judged_as()}: one would judge trials the other misreads",
                    self.search.metric,
                    "give both the same metric and mode",
                )
            )
        return issues

    def plan_issues(self) -> list[ConfigIssue]:
        """`from_plan` needs a `plan` and replaces the grid and the random draws."""
        issues = []
        if self.from_plan is not None and self.plan is None:
            issues.append(
                ConfigIssue(
                    "plan",
                    "from_plan needs the plan file",
                    MISSING,
                    "add e.g. plan: PLAN.yaml (made by rayacc plan -c JOB.yaml --search)",
                )
            )
        if self.from_plan is not None and (self.grid or self.random.samples):
            issues.append(
                ConfigIssue(
                    "from_plan",
                    "the plan's candidates are the trials: a grid or random draws beside them "
                    "would not keep its settings",
                    self.from_plan,
                    "remove `grid` and `random`, or `from_plan`",
                )
            )
        if self.plan is not None and self.from_plan is None:
            issues.append(
                ConfigIssue(
                    "from_plan",
                    "a plan is given but not how many of its candidates to run",
                    MISSING,
                    "add e.g. from_plan: 3",
                )
            )
        return issues

    def trial_issues(self) -> list[ConfigIssue]:
        """The trials the file describes, at least one: each grid key with values, each random
        distribution one that can be drawn from (a draw that cannot be made would end the
        sweep midway; a grid key without values would make it a sweep of no trial)."""
        issues = [
            ConfigIssue(
                f"grid.{key}",
                "has no values: the grid would hold no trial",
                values,
                "give at least one value, or remove the key",
            )
            for key, values in self.grid.items()
            if not isinstance(values, list) or not values
        ]
        space, samples = self.random.space, self.random.samples
        if samples and not space:
            issues.append(
                ConfigIssue(
                    "random.space",
                    f"is empty while random.samples is {samples}",
                    MISSING,
                    "give key paths to draw, e.g. {optim.lr: {loguniform: "
                    "[0.0001, 0.01]}}, or set random.samples: 0",
                )
            )
        if space and not samples:
            issues.append(
                ConfigIssue(
                    "random.samples",
                    "is 0, so random.space would never be drawn from",
                    samples,
                    "set random.samples to the draws wanted, or remove random.space",
                )
            )
        for key, dist in space.items():
            if len(dist) != 1 or next(iter(dist)) not in DISTRIBUTIONS:
                continue  # named by setting_issues
            ((kind, args),) = dist.items()
            if problem := _draw_problem(kind, args):
                issues.append(ConfigIssue(f"random.space.{key}.{kind}", problem, args, None))
        return issues

    def setting_issues(self, base: dict[str, Any]) -> list[ConfigIssue]:
        """Every key the grid and the random space name must be a config field, and every value
        they can give (each grid value, each choice, the bounds of a range) one of its type:
        each checked on the base, before any trial starts. (A combination that fails a rule
        across fields, e.g. a micro-batch that does not divide the global batch, is a trial
        the sweep skips and reports, not a mistake in the file.)"""
        issues: list[ConfigIssue] = []
        candidates: list[tuple[str, str, Any]] = [
            (f"grid.{key}", key, v) for key, values in self.grid.items() for v in values
        ]
        for key, dist in self.random.space.items():
            where = f"random.space.{key}"
            if len(dist) != 1 or next(iter(dist)) not in DISTRIBUTIONS:
                issues.append(
                    ConfigIssue(
                        where,
                        "is not one distribution",
                        dist,
                        "give one of " + ", ".join(f"{{{d}: [..]}}" for d in DISTRIBUTIONS),
                    )
                )
                continue
            ((kind, args),) = dist.items()
            if kind != "choice" and len(args) != 2:
                issues.append(ConfigIssue(where, f"{kind} takes [low, high]", args, None))
                continue
            candidates += [(where, key, v) for v in args]
        for where, key, value in candidates:
            data = copy.deepcopy(base)
            node = data
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {}) if isinstance(node, dict) else {}
            if isinstance(node, dict):
                node[leaf] = value
            try:
                TrainConfig.model_validate(data)
            except ValidationError as exc:
                for issue in issues_from_validation(exc, TrainConfig):
                    issue.path = f"{where}: {issue.path}"
                    if all(str(i) != str(issue) for i in issues):
                        issues.append(issue)
        return issues


def _draw_problem(kind: str, args: list[Any]) -> str | None:
    """Why a distribution cannot be drawn from, None when it can."""
    if kind == "choice":
        return None if args else "has no values to choose from"
    if len(args) != 2 or not all(
        isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a) for a in args
    ):
        return f"{kind} takes [low, high], two finite numbers"
    lo, hi = args
    if kind == "randint" and not all(isinstance(a, int) for a in args):
        return "randint takes two whole numbers (high exclusive)"
    if not lo < hi:
        return f"low {lo} is not below high {hi}"
    if kind == "loguniform" and lo <= 0:
        return "loguniform draws between two positive numbers"
    return None
