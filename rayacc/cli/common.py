"""What the commands share: loading a job with its overrides, the console, the process-wide
settings of a command that drives a run, and the user errors that exit 2."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from rayacc import env
from rayacc.config import ConfigError, TrainConfig

EXIT_USER_ERROR = 2


def _load(args: argparse.Namespace, given: list[str] | None = None) -> TrainConfig:
    """The job file with the command line's overrides (`given`: these instead, e.g. a
    resume's), and those a submitted job received in its environment
    (`jobs.SECRET_OVERRIDES`: the ones that carry credentials)."""
    return TrainConfig.from_yaml(args.config, overrides=[*(given or _given(args)), *_hidden()])


def _hidden() -> list[str]:
    import json

    from rayacc.driver.jobs import SECRET_OVERRIDES

    return json.loads(os.environ.get(SECRET_OVERRIDES) or "[]")


def _given(args: argparse.Namespace) -> list[str]:
    """The overrides the command gives: the plan's settings (`--plan`), then the command
    line's (which win)."""
    overrides = list(args.overrides)
    if getattr(args, "plan", None):
        from rayacc.planner.planfile import PlanFile

        plan = PlanFile.read(args.plan)
        job = TrainConfig.from_yaml(args.config, overrides=[*overrides, *_hidden()])
        overrides = [*plan.overrides_for(job, str(args.config)), *overrides]
    return overrides


def _console_owns_ray_output() -> None:
    """Process-wide settings for a run driven from this command: rayacc prints its own progress,
    so Ray's copies of worker prints stay out of the console, and the Train controller polls its
    workers every 0.2 s instead of 2 s (it notices a started or finished group that much
    sooner: seconds at the start and end of every run, for a few cheap calls)."""
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    # MLflow resets its logger's level when it is imported (later, in a thread): its INFO
    # lines (a new store's table creation) stay off the console
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    # the tracking sink retries on its own, every 2 s, off the training path: MLflow's client
    # retrying each call for minutes would only delay the line that says the server is away
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    # MLflow prints "🏃 View run … / 🧪 View experiment …" when a run on a server ends (in a
    # submitted job's output too); the run's summary says where it is, in rayacc's words
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    if not env.verbose():
        # a sweep's console is rayacc's trial lines: Tune's own reporter (a config table,
        # where its results are, a TensorBoard hint) stays quiet at verbose=0 only in its
        # classic engine, and its automatic TensorBoard/CSV/JSON loggers write files nobody reads
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
        os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")


def _user_error_types() -> tuple[type[BaseException], ...]:
    from rayacc.checkpoint.reader import CheckpointError
    from rayacc.config.batch_split import BatchSplitError
    from rayacc.data.common import DataError
    from rayacc.driver.jobs import SubmitError
    from rayacc.driver.places import PlaceError
    from rayacc.driver.prelaunch import ResourceError
    from rayacc.engine.parallel import DeepSpeedConfigError, StrategyLoadError
    from rayacc.models import ModelError
    from rayacc.planner.search import NothingFits
    from rayacc.tracking.report import ReportError

    return (
        ConfigError,
        BatchSplitError,
        DataError,
        ModelError,
        CheckpointError,
        ReportError,
        SubmitError,
        ResourceError,
        PlaceError,
        NothingFits,
        DeepSpeedConfigError,
        StrategyLoadError,
    )


def _console():
    from rayacc.observe.console import make_console

    # tables need room: a pipe or a file gets 160 columns instead of rich's default 80
    return make_console(width=None if sys.stdout.isatty() else 160)
