"""`rayacc train` and `rayacc verify`."""

from __future__ import annotations

import argparse
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rayacc.cli.common import (
    _console_owns_ray_output,
    _given,
    _hidden,
    _load,
)
from rayacc.redact import redact


def cmd_train(args: argparse.Namespace) -> int:
    """Runs a training job and prints its summary."""
    import time

    t_main = time.time()
    from rayacc.driver.fit import TrainingError, ensure_ray, fit
    from rayacc.driver.prelaunch import locate, prepare
    from rayacc.driver.resume import resume_config
    from rayacc.observe.console import (
        ProgressPrinter,
        make_console,
        run_header,
        styled,
        summary_lines,
    )

    t_imported = time.time()
    # paths and URIs stay on one line, copyable
    console, err = make_console(), make_console(stderr=True)
    _console_owns_ray_output()
    given = _given(args)
    # every user mistake surfaces here, before Ray starts
    resumed = None
    if args.resume:
        # the run as it was started, with only what is given now changed (the driver's rule)
        cfg, prep, resumed = resume_config(args.config, given, extra=_hidden())
        if resumed is not None:
            given = resumed.overrides
    else:
        cfg = _load(args, given)
        prep = prepare(cfg)
    location = locate(prep.spec.cfg.run, args.resume, prep.spec.resume_terms)
    location.overrides = given
    if args.resume and (location.resume_step or 0) >= prep.total_steps:
        for line in resumed.lines() if resumed else ():
            console.print(redact(line))
        console.print(
            f"run {location.name!r} is finished: its checkpoint at step {location.resume_step} "
            f"is the last of its {prep.total_steps} steps; nothing to resume. To train it "
            f"longer: rayacc train -c {args.config} --resume run.name={location.name} "
            "train.max_steps=MORE"
        )
        return 0
    t_checked = time.time()
    with ThreadPoolExecutor(1, thread_name_prefix="rayacc-imports") as pool:
        # Ray's start is mostly other processes' work: the modules the fit needs next load
        # meanwhile instead of after it
        pool.submit(_import_ray_layer)
        ensure_ray(cfg.scaling)
    t_ray = time.time()
    console.print(styled(("rayacc train", "bold"), f" {args.config}"))
    if args.plan:
        console.print(f"  settings from the plan {args.plan}")
    for line in run_header(cfg, prep, redact(prep.info.path)):
        console.print(f"  {line}")
    if cfg.tracking.enabled:
        from rayacc.tracking import tracking_target

        target = tracking_target(cfg.tracking.tracking_uri, cfg.tracking.experiment)
        console.print(f"  {redact(target.describe())}")
    for line in resumed.lines() if resumed else ():
        console.print(f"  {redact(line)}")
    for w in [*prep.warnings, *location.notes]:
        err.print(styled(("warning:", "yellow"), f" {w}"))

    try:
        with ProgressPrinter(
            console, prep.total_steps, bar=True, elastic=cfg.scaling.elastic
        ) as display:
            result = fit(
                cfg,
                resume=args.resume,
                observers=[display],
                prepared=prep,
                location=location,
                # the run's source in MLflow: the command that started it (masked, as every tag)
                tags={"mlflow.source.name": shlex.join(["rayacc", *sys.argv[1:]])},
            )
    except TrainingError as exc:
        err.print(styled((f"rayacc: {exc}", "red")))
        return 1
    except KeyboardInterrupt:
        # what the interruption kept, and the command that goes on from it
        latest = location.checkpoints.latest()
        kept = (
            f"the last complete checkpoint is step {latest.step} ({redact(latest.uri)})"
            if latest is not None
            else "no checkpoint was complete yet (a resume starts from the beginning)"
        )
        err.print(
            f"rayacc: interrupted; {kept}. Resume: rayacc train -c {args.config} --resume "
            f"run.name={location.name}"
        )
        return 130
    heading, *lines = summary_lines(cfg, result)
    console.print(heading)
    for line in lines:
        console.print(styled("  ", line))
    if args.timings:
        result.phases.update(
            main_entered=t_main, imported=t_imported, cli_checked=t_checked, cli_ray_started=t_ray
        )
        _write_timings(args.timings, result)
    return 0


def _write_timings(path: str, result) -> None:
    """The fit's phase timestamps (driver) and rank 0's timeline, as JSON."""
    import json

    run = {k: result.summary.get(k) for k in ("device", "backend", "split", "train_time_s")}
    timings = {
        "driver": result.phases,
        "worker": result.summary.get("timeline", {}),
        "run": {**run, "checkpoint_dir": result.checkpoint_dir},
    }
    Path(path).write_text(json.dumps(redact(timings), indent=1))


def _import_ray_layer() -> None:
    import ray.data
    import ray.train.torch  # noqa: F401


def cmd_verify(args: argparse.Namespace) -> int:
    from rich.table import Table

    from rayacc.driver.verify import FLOOR_FACTOR, verify
    from rayacc.observe.console import make_console, styled

    console, err = make_console(), make_console(stderr=True)
    _console_owns_ray_output()
    cfg = _load(args)
    result = verify(cfg)
    for w in result.warnings:
        err.print(styled(("warning:", "yellow"), f" {w}"))
    split = result.split
    table = Table(title=f"one step of {split.describe()}, {cfg.train.precision}, vs one process")
    columns = ("parameter", "max abs diff", "rel diff ‖w_ray − w_exact‖/‖Δw_exact‖",
               "one-process fp32 rel diff")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right")
    for d in result.diffs:
        table.add_row(d.name, f"{d.max_abs:.3e}", f"{d.max_rel:.3e}", f"{d.floor:.3e}")
    console.print(table)
    verdict = ("PASS", "green") if result.passed else ("FAIL", "red")
    worst = result.worst
    console.print(
        styled(
            verdict,
            f": nearest its bound {worst.name}, relative difference {worst.max_rel:.3e}, bound "
            f"{worst.allowed(result.tolerance):.3e} (tolerance {result.tolerance:g} for "
            f"{cfg.train.precision}, or {FLOOR_FACTOR:g} × the one-process fp32 step's own "
            f"{worst.floor:.3e}); w_exact: the one-process float64 step",
        )
    )
    if result.mlflow_run_id:
        console.print(f"  MLflow run {result.mlflow_run_id} tagged rayacc.verified")
    return 0 if result.passed else 1
