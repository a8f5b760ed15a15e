"""The sweep's trials in Ray Tune: the function each trial runs (one full fit, nested under the
sweep's parent run), what it reports to Tune, Tune's scheduler and search algorithm by the
sweep's names, and the callback that relays trial events to the sweep's driver."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

from rayacc.config import SweepConfig, TrainConfig
from rayacc.observe.events import RunObserver
from rayacc.redact import redact

__all__ = [
    "index_of",
    "scheduler_of",
    "search_of",
    "search_space",
    "trial_events",
    "trial_function",
]


def scheduler_of(sweep: SweepConfig):
    """Ray Tune's scheduler the sweep names (None: none), judging trials by the optimizer step
    (`step` in each report) so its grace period counts steps, whatever the metric's cadence."""
    if sweep.scheduler is None:
        return None
    from ray.tune.schedulers import AsyncHyperBandScheduler, MedianStoppingRule

    s = sweep.scheduler
    metric, mode = s.judged_as()
    if s.name == "asha":
        # max_t past any run's steps: ASHA ends every trial at max_t, a cut no trial asked for
        extra = {"reduction_factor": s.reduction_factor} if s.reduction_factor else {}
        return AsyncHyperBandScheduler(
            time_attr="step", metric=metric, mode=mode, grace_period=s.grace_period,
            max_t=2**40, **extra,
        )  # fmt: skip
    return MedianStoppingRule(
        time_attr="step", metric=metric, mode=mode, grace_period=s.grace_period,
        min_samples_required=2,
    )  # fmt: skip


def search_of(sweep: SweepConfig):
    """Ray Tune's search algorithm the sweep names (None: the trials listed up front)."""
    if sweep.search is None:
        return None
    metric, mode = sweep.search.judged_as()
    seed = sweep.random.seed
    if sweep.search.name == "optuna":
        import optuna
        from ray.tune.search.optuna import OptunaSearch

        optuna.logging.set_verbosity(optuna.logging.WARNING)  # its study's lines: not rayacc's
        return OptunaSearch(metric=metric, mode=mode, seed=seed)
    from ray.tune.search.hyperopt import HyperOptSearch

    return HyperOptSearch(metric=metric, mode=mode, random_state_seed=seed)


def search_space(sweep: SweepConfig) -> dict[str, Any]:
    """`random.space` as Tune's search space, under `settings`."""
    from ray import tune

    def domain(dist: dict[str, list[Any]]):
        ((kind, args),) = dist.items()
        return tune.choice(args) if kind == "choice" else getattr(tune, kind)(*args)

    return {"settings": {p: domain(d) for p, d in sweep.random.space.items()}}


def index_of(tag: str) -> int:
    """A proposed trial's number from 0: Tune's search generator starts each trial's tag with
    its count from 1 (`3_optim.lr=…`), and the trial's folder name holds the tag after its id."""
    return int(tag.split("_", 1)[0]) - 1


def trial_function(
    configs: dict[int, dict[str, Any]],
    uri: str,
    parent_id: str | None,
    predicted: dict[int, dict[str, str]] | None = None,
    names: dict[int, str] | None = None,
    judged: tuple[str, str] | None = None,
    trial_fit: Callable | None = None,
    proposed: Callable[[int, dict[str, Any]], Any] | None = None,
):
    """Tune's function trainable: one full fit of trial `config["trial"]`, nested under the
    sweep's parent run (tagged with what a plan predicted for it, `rayacc.predicted_*`). With
    a scheduler (`judged`: its metric), each step that logs the metric is reported to Tune,
    which may stop the trial there; every result carries the metric, as Tune requires. With a
    search algorithm the trial is what `proposed(index, settings)` makes of the settings it
    proposed (`config["settings"]`): checked here as the listed trials are up front."""
    predicted = predicted or {}
    from rayacc.driver.fit import fit

    fit = trial_fit or fit
    observers = [_TuneReports(judged[0])] if judged else []

    def trial_fn(config: dict[str, Any]) -> dict[str, Any]:
        judged_now = {judged[0]: math.nan, "step": 0} if judged else {}
        if proposed is not None:
            from ray import tune

            context = tune.get_context()
            folder = os.path.basename(context.get_trial_dir())
            index = index_of(folder.split(f"{context.get_trial_id()}_", 1)[1])
            trial = proposed(index, config["settings"])
            if trial.config is None:  # the searcher learns it failed
                return {"ok": False, "error": trial.skip_reason, **judged_now}
            settings, name = trial.config, trial.label()
        else:
            index = config["trial"]
            settings, name = configs[index], (names or {}).get(index)
        tags = {"rayacc.trial": index, **predicted.get(index, {})}
        cfg = TrainConfig.model_validate(settings)
        # the trial's own TorchTrainer must not ask Tune for the sweep's tracking settings
        tracking = {"tracking_uri": uri}
        if name and not cfg.tracking.run_name:
            tracking["run_name"] = name
        cfg = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update=tracking)})
        t_start = time.perf_counter()
        try:
            r = fit(cfg, parent_run_id=parent_id, tags=tags, observers=observers)
        except Exception as exc:
            return {
                "ok": False,
                # Tune keeps the result in the sweep's storage (result.json)
                "error": redact(str(exc)).splitlines()[0][:500],
                "wall_time_s": time.perf_counter() - t_start,
                **judged_now,
            }
        if judged:
            last = [h for h in r.history if judged[0] in h]
            if last:
                judged_now = {judged[0]: float(last[-1][judged[0]]), "step": last[-1]["step"]}
        return {
            "ok": True,
            "mlflow_run_id": r.mlflow_run_id,
            "metrics": r.metrics,
            "split": r.summary.get("split"),
            "wall_time_s": r.wall_time_s,
            **judged_now,
        }

    return trial_fn


class _TuneReports(RunObserver):
    """Reports each step's judged metric to Ray Tune from inside a trial (with the step, the
    scheduler's clock)."""

    def __init__(self, metric: str):
        self.metric = metric

    def on_step(self, record: dict[str, Any]) -> None:
        value = record.get(self.metric)
        if isinstance(value, int | float):
            from ray import tune

            tune.report({self.metric: float(value), "step": int(record["step"])})


def trial_events(record: Callable[[str, int, dict[str, Any]], None]):
    """A Tune callback that relays trial events to `record` in the sweep driver."""
    from ray import tune

    class TrialEvents(tune.Callback):
        # no closure over `record`: Tune pickles its callbacks with the experiment state
        def __getstate__(self):
            return {}

        def _record(self, kind, trial, outcome):
            config = trial.config
            index = config["trial"] if "trial" in config else index_of(trial.experiment_tag)
            self.record(kind, index, outcome, config.get("settings"))

        def on_trial_start(self, iteration, trials, trial, **info):
            self._record("started", trial, {})

        def on_trial_complete(self, iteration, trials, trial, **info):
            outcome = trial.last_result or {}
            if "ok" not in outcome and "step" in outcome:  # a step's report: the scheduler's stop
                self._record("stopped", trial, dict(outcome))
                return
            self._record("finished" if outcome.get("ok") else "failed", trial, outcome)

        def on_trial_error(self, iteration, trials, trial, **info):
            self._record("failed", trial, {"ok": False, "error": "the trial process failed"})

    callback = TrialEvents()
    callback.record = record
    return callback
