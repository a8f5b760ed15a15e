"""Sweeps of accumulation settings: every trial a full TorchTrainer run through Ray Tune, each a
nested MLflow run under one parent run."""

from __future__ import annotations

import copy
import functools
import itertools
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rayacc.config import ConfigError, SweepConfig, TrainConfig
from rayacc.config.rules import strategy_resets
from rayacc.driver.sweep_tune import (
    scheduler_of,
    search_of,
    search_space,
    trial_events,
    trial_function,
)
from rayacc.redact import redact
from rayacc.redact.origins import register_run

__all__ = ["SweepResult", "Trial", "best_trial", "expand_trials", "run_sweep"]


@dataclass
class Trial:
    index: int
    settings: dict[str, Any]
    """The key paths this trial sets, as given in the sweep."""
    config: dict[str, Any] | None = None
    """The validated training config, or None when the combination is invalid."""
    skip_reason: str | None = None
    predicted: dict[str, float] = field(default_factory=dict)
    """A trial from a plan: the planner's predicted step time (s) and memory per rank (MiB)."""

    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.settings.items())


@dataclass
class SweepResult:
    parent_run_id: str | None
    tracking_uri: str
    experiment: str
    trials: list[Trial]
    outcomes: dict[int, dict[str, Any]] = field(default_factory=dict)
    wall_time_s: float = 0.0


def _set_path(data: dict[str, Any], path: str, value: Any) -> None:
    node = data
    *parents, leaf = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def _draw(rng: random.Random, dist: dict[str, list[Any]], path: str) -> Any:
    if len(dist) != 1:
        raise ValueError(f"random.space.{path}: give one distribution, e.g. {{choice: [8, 16]}}")
    ((kind, args),) = dist.items()
    if kind == "choice":
        return rng.choice(args)
    lo, hi = args
    if kind == "uniform":
        return rng.uniform(lo, hi)
    if kind == "loguniform":
        return math.exp(rng.uniform(math.log(lo), math.log(hi)))
    if kind == "randint":
        return rng.randrange(lo, hi)
    raise ValueError(
        f"random.space.{path}: unknown distribution {kind!r} (choice, uniform, loguniform, randint)"
    )


def expand_trials(sweep: SweepConfig, base: dict[str, Any]) -> list[Trial]:
    """The grid × random settings (or a plan's best candidates) applied to the base; invalid
    ones carry their reason."""
    base_cfg = TrainConfig.model_validate(base)
    register_run(base_cfg)  # the parent run's records know the base's secrets
    predicted: list[dict[str, float]] = []
    if sweep.from_plan:
        settings, predicted = _from_plan(sweep, base_cfg)
    else:
        keys = list(sweep.grid)
        settings = [dict(zip(keys, values)) for values in itertools.product(*sweep.grid.values())]
        if not keys:
            settings = [{}] if not sweep.random.samples else []
        rng = random.Random(sweep.random.seed)
        for _ in range(sweep.random.samples):
            settings.append({p: _draw(rng, d, p) for p, d in sweep.random.space.items()})

    return [
        trial_of(sweep, base, i, one, predicted[i] if predicted else {})
        for i, one in enumerate(settings)
    ]


def trial_of(
    sweep: SweepConfig,
    base: dict[str, Any],
    index: int,
    settings: dict[str, Any],
    predicted: dict[str, float] | None = None,
) -> Trial:
    """Trial `index`: `settings` applied to the base (invalid ones carry their reason)."""
    base_cfg = TrainConfig.model_validate(base)
    data = copy.deepcopy(base)
    # a trial of another strategy leaves the base's settings for the base's strategy
    switched = settings.get("train.strategy", base_cfg.train.strategy)
    for path, value in {**strategy_resets(base_cfg, switched), **settings}.items():
        _set_path(data, path, value)
    if base.get("run", {}).get("name") and "run.name" not in settings:
        # a run name means one run: each trial its own folder
        data["run"]["name"] = f"{base['run']['name']}-trial{index}"
    if sweep.hold == "global_batch_size":
        data["batch"]["global_batch_size"] = base_cfg.batch_split().global_batch_size
        if "batch.grad_accum_steps" not in settings:
            # derived per trial, so the global batch stays what the base says
            data["batch"]["grad_accum_steps"] = None
    try:
        cfg = TrainConfig.from_dict(data)
    except ConfigError as exc:
        return Trial(index, settings, None, "; ".join(str(issue) for issue in exc.issues))
    return Trial(index, settings, cfg.model_dump(mode="json"), predicted=predicted or {})


def taken_run_names(sweep: SweepConfig, base: dict[str, Any]) -> None:
    """A named base gives each trial a run of its own (`<name>-trial<i>`); a sweep run again
    into the same storage would find them there and every trial would fail where it starts:
    refused before anything runs, naming them (DataError)."""
    from rayacc.data.common import DataError
    from rayacc.driver.runs import default_storage, run_names, storage_exists

    cfg = TrainConfig.model_validate(base)
    storage = default_storage(cfg.run.storage_path)
    if not cfg.run.name or not storage_exists(storage):
        return
    if sweep.search:
        names = [f"{cfg.run.name}-trial{i}" for i in range(sweep.random.samples)]
    else:
        names = [t.config["run"]["name"] for t in expand_trials(sweep, base) if t.config]
    taken = sorted(set(names) & run_names(storage))
    if taken:
        raise DataError(
            f"run.name={cfg.run.name!r}: the trials' runs {', '.join(taken[:5])}"
            f"{' …' if len(taken) > 5 else ''} are already in {storage} (this sweep ran "
            "before); each trial would be refused where it starts. Fix: give the base another "
            "run.name (an override in the sweep's `overrides`), or leave it unset for fresh "
            "unique names"
        )


def proposal(sweep: SweepConfig, base: dict[str, Any], index: int, chosen: dict) -> Trial:
    """Trial `index` as a search algorithm chose it, its settings in the order of the sweep's
    space (Tune sorts them)."""
    return trial_of(sweep, base, index, {k: chosen[k] for k in sweep.random.space})


def _from_plan(
    sweep: SweepConfig, base: TrainConfig
) -> tuple[list[dict[str, Any]], list[dict[str, float]]]:
    """The plan's best `from_plan` candidates as trial settings, and their predictions; the
    plan must have been made for the sweep's base job (ConfigError otherwise)."""
    from rayacc.planner.planfile import PlanFile

    assert sweep.plan is not None and sweep.from_plan is not None
    plan = PlanFile.read(sweep.plan)
    plan.check_job(base, sweep.plan)
    settings, predicted = [], []
    for candidate, row in plan.best(sweep.from_plan):
        settings.append(candidate.overrides())
        predicted.append(
            {
                k: row[k]
                for k in ("predicted_step_s", "predicted_memory_mb")
                if row.get(k) is not None
            }
        )
    return settings, predicted


def _concurrency(sweep: SweepConfig, configs: list[TrainConfig]) -> int:
    import ray

    if sweep.max_concurrent_trials:
        return sweep.max_concurrent_trials
    total = ray.cluster_resources()
    if any(c.scaling.use_gpu for c in configs):
        per_trial = max(c.scaling.max_workers for c in configs)
        return max(1, int(total.get("GPU", 0) // per_trial))
    # each trial's workers plus one CPU for its Ray Data tasks
    per_trial = max(c.scaling.max_workers * c.scaling.cpus_per_worker + 1 for c in configs)
    return max(1, int(total.get("CPU", 1) // per_trial))


def run_sweep(
    sweep: SweepConfig,
    base: dict[str, Any],
    sweep_text: str,
    on_event: Callable[[str, Trial, dict[str, Any]], None] | None = None,
    *,
    trial_fit: Callable | None = None,
) -> SweepResult:
    """Runs the valid trials (skipped ones are recorded on the parent run) and returns outcomes;
    `trial_fit`: what each trial runs in place of `fit` (same arguments and result)."""
    from ray import tune

    from rayacc.driver.fit import ensure_ray
    from rayacc.tracking import tracking_target

    t0 = time.perf_counter()
    # a search algorithm proposes each trial as the sweep goes
    trials = [] if sweep.search else expand_trials(sweep, base)
    valid = [t for t in trials if t.config is not None]
    base_cfg = TrainConfig.model_validate(base)
    target = tracking_target(base_cfg.tracking.tracking_uri, base_cfg.tracking.experiment)
    uri = target.uri
    name = sweep.name or f"sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    parent = _open_parent(sweep, trials, uri, target.experiment, name, sweep_text)
    result = SweepResult(parent.run_id, uri, target.experiment, trials)
    for t in trials:
        if t.skip_reason and on_event:
            on_event("skipped", t, {"reason": t.skip_reason})
    if not valid and not sweep.search:
        parent.finish("FAILED")
        return result

    configs = {t.index: t.config for t in valid}
    by_index = {t.index: t for t in valid}

    def record(kind: str, index: int, outcome: dict[str, Any], settings=None) -> None:
        if index not in by_index:  # proposed by the search
            by_index[index] = Trial(index, {k: settings[k] for k in sweep.random.space})
            result.trials.append(by_index[index])
        if kind == "stopped" and sweep.scheduler is not None:
            metric, _ = sweep.scheduler.judged_as()
            outcome = {
                "ok": False,
                "stopped_early": f"at step {outcome.get('step')} by {sweep.scheduler.name} "
                f"({metric} {outcome.get(metric, math.nan):.4g})",
            }
            _mark_stopped(parent, index, outcome["stopped_early"])
        if kind != "started":
            result.outcomes[index] = outcome
        if on_event:
            on_event(kind, by_index[index], outcome)

    ensure_ray(base_cfg.scaling)
    concurrency = _concurrency(
        sweep, [TrainConfig.model_validate(c) for c in configs.values()] or [base_cfg]
    )
    judged = sweep.search or sweep.scheduler  # one metric for both (the config's rule)
    tuner = tune.Tuner(
        # the trial function only waits on its TorchTrainer, whose workers hold the resources
        tune.with_resources(
            trial_function(
                configs,
                uri,
                parent.run_id,
                {
                    t.index: {f"rayacc.{k}": str(v) for k, v in t.predicted.items()}
                    for t in valid
                    if t.predicted
                },
                # a child run is named by what it tries, as a sweep's users look for it
                {t.index: t.label() or f"trial {t.index}" for t in valid},
                judged.judged_as() if judged else None,
                trial_fit,
                functools.partial(proposal, sweep, base) if sweep.search else None,
            ),
            {"cpu": 0.01},
        ),
        param_space=(
            search_space(sweep) if sweep.search else {"trial": tune.grid_search(list(configs))}
        ),
        tune_config=tune.TuneConfig(
            max_concurrent_trials=concurrency,
            scheduler=scheduler_of(sweep),
            search_alg=search_of(sweep),
            num_samples=sweep.random.samples if sweep.search else 1,
        ),
        run_config=tune.RunConfig(
            name=name,
            storage_path=_abs_storage(base_cfg.run.storage_path),
            callbacks=[trial_events(record)],
            verbose=0,
        ),
    )
    tuner.fit()
    stopped = {i: o["stopped_early"] for i, o in result.outcomes.items() if "stopped_early" in o}
    ended = sorted({*configs, *result.outcomes})
    failed = [i for i in ended if not result.outcomes.get(i, {}).get("ok") and i not in stopped]
    best = best_trial(result.outcomes)
    parent.set_tags(
        {
            "rayacc.failed_trials": ",".join(map(str, failed)) or "none",
            **({"rayacc.stopped_trials": ",".join(map(str, stopped))} if stopped else {}),
            "rayacc.concurrency": concurrency,
            **({"rayacc.best_trial": by_index[best[0]].label()} if best else {}),
        }
    )
    if best:
        parent.log_step_metrics([{"step": 0, f"best/{best[1]}": best[2]}])
    parent.finish("FINISHED")
    result.wall_time_s = time.perf_counter() - t0
    return result


def _mark_stopped(parent, index: int, why: str) -> None:
    """The MLflow run of trial `index`, which the scheduler stopped: ended KILLED, tagged
    `rayacc.stopped_early` with when and why, as Tune reports the stop (its process ends with
    it: the run cannot say so itself)."""
    if not parent.active:
        return
    try:
        runs = parent.client.search_runs(
            [parent.experiment_id],
            filter_string=f"tags.mlflow.parentRunId = '{parent.run_id}' "
            f"and tags.`rayacc.trial` = '{index}'",
        )
        for run in runs:
            parent.client.set_tag(run.info.run_id, "rayacc.stopped_early", why)
            parent.client.set_terminated(run.info.run_id, "KILLED")
    except Exception as exc:  # the store away: the sweep goes on, the console said it
        said = redact(str(exc)).splitlines()[0][:200]
        print(f"rayacc: trial {index}'s MLflow run not marked stopped: {said}", file=sys.stderr)


def _open_parent(sweep: SweepConfig, trials: list[Trial], uri, experiment, name, sweep_text):
    """The sweep's parent MLflow run, with the sweep file and the skipped trials' reasons."""
    from rayacc.tracking import MlflowSink

    valid = [t for t in trials if t.config is not None]
    # a search's trials are proposed as it goes: as many as it is asked for
    count = sweep.random.samples if sweep.search else len(valid)
    parent = MlflowSink(uri, experiment, name)
    parent.set_tags(
        {
            "rayacc.sweep": "true",
            "rayacc.hold": sweep.hold or "none",
            "rayacc.trials": count,
            "rayacc.skipped": len(trials) - len(valid),
        }
    )
    parent.log_text(sweep_text, "sweep.yaml")
    # the sweep's own settings as the parent's params: what it varied and what it held
    parent.log_params(
        {
            "hold": sweep.hold or "none",
            "trials": count,
            **{f"grid.{key}": values for key, values in sweep.grid.items()},
            **({"search": sweep.search.name} if sweep.search else {}),
            **({"scheduler": sweep.scheduler.name} if sweep.scheduler else {}),
        }
    )
    if len(valid) < len(trials):
        parent.log_text(
            "\n".join(
                f"trial {t.index} ({t.label()}): {t.skip_reason}" for t in trials if t.skip_reason
            ),
            "skipped.txt",
        )
    return parent


def best_trial(outcomes: dict[int, dict[str, Any]]) -> tuple[int, str, float] | None:
    """(trial, metric, value) of the lowest final validation loss among the trials that
    finished (their training loss where none validated); None when none finished."""
    finished = {i: o.get("metrics") or {} for i, o in outcomes.items() if o.get("ok")}
    for key in ("val/loss", "train/loss"):
        scored = {i: m[key] for i, m in finished.items() if isinstance(m.get(key), float)}
        if scored:
            index = min(scored, key=scored.get)
            return index, key.replace("/", "_"), scored[index]
    return None


def _abs_storage(storage: str | None) -> str:
    from pathlib import Path

    if storage and "://" in storage:
        return storage
    return str(Path(storage or Path.cwd() / "rayacc_runs").expanduser().resolve() / "sweeps")
