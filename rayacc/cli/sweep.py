"""`rayacc sweep` and `rayacc report`."""

from __future__ import annotations

import argparse
from pathlib import Path

from rayacc.cli.common import (
    _console,
    _console_owns_ray_output,
)
from rayacc.config import TrainConfig

REPORT_OUT = "rayacc_report"
"""Where `rayacc report` writes without --out."""


def cmd_sweep(args: argparse.Namespace) -> int:
    """Runs every trial of a sweep, then prints the comparison table."""

    from rayacc.config import SweepConfig
    from rayacc.driver.sweep import run_sweep, taken_run_names
    from rayacc.observe.console import styled, val_parts
    from rayacc.tracking.report import build_report

    console = _console()
    _console_owns_ray_output()
    sweep, base, source = SweepConfig.from_yaml(args.config)
    from rayacc.driver.prelaunch import check

    # the base as every trial shares it: its places, data, model and batch against the data
    check(TrainConfig.model_validate(base), "run")
    taken_run_names(sweep, base)
    console.print(styled(("rayacc sweep", "bold"), f" {source}"))

    def on_event(kind, trial, info):
        if kind == "skipped":
            console.print(
                styled(
                    "  ",
                    ("skipped", "yellow"),
                    f" trial {trial.index} ({trial.label()}): {info['reason']}",
                )
            )
        elif kind == "started":
            console.print(f"  trial {trial.index} started: {trial.label()}")
        elif kind == "stopped":
            console.print(f"  trial {trial.index} stopped early {info['stopped_early']}")
        elif kind == "finished":
            m = info.get("metrics", {})
            val = "".join(f", {part}" for part in val_parts(m))
            loss = m.get("train/loss", float("nan"))
            console.print(
                f"  trial {trial.index} finished: train loss {loss:.4f}"
                f"{val}, {info.get('wall_time_s', 0):.1f} s"
            )
        else:
            console.print(
                styled("  ", (f"trial {trial.index} failed", "red"), f": {info.get('error')}")
            )

    result = run_sweep(sweep, base, Path(args.config).read_text(), on_event)
    console.print(
        f"sweep done in {result.wall_time_s:.1f} s; MLflow parent run {result.parent_run_id}"
    )
    if result.parent_run_id and any(o.get("ok") for o in result.outcomes.values()):
        _print_report(console, build_report(result.tracking_uri, result.parent_run_id))
        console.print(f"  plots and CSV: rayacc report {result.parent_run_id} --out DIR")
    # a trial the scheduler stopped did what the sweep asked of it
    done = [o.get("ok") or "stopped_early" in o for o in result.outcomes.values()]
    return 0 if all(done) else 1


def _print_report(console, report) -> None:
    from rich.table import Table

    from rayacc.tracking.report import COLUMNS, table_rows

    table = Table(title=f"sweep {report.parent_run_id}")
    for _, title in COLUMNS:
        table.add_column(title, justify="right")
    for cells in table_rows(report):
        table.add_row(*(cells[key] for key, _ in COLUMNS))
    console.print(table)
    for line in report.verdict():
        console.print(f"  {line}")


def cmd_report(args: argparse.Namespace) -> int:

    from rayacc.driver.places import PlaceError, check_folder, check_tracking_uri
    from rayacc.redact import redact
    from rayacc.tracking import default_tracking_uri
    from rayacc.tracking.report import build_report, write_report

    console = _console()
    uri = args.tracking_uri or default_tracking_uri()
    out = args.out or REPORT_OUT
    if not args.tracking_uri and (recorded := _recorded_elsewhere(args.target, uri)):
        # a run of this folder's rayacc_runs tracked in another store (a cluster's): read it
        # there where it can be read, or name it
        where = f"the store run {args.target!r} was recorded in (its rayacc_run.json)"
        if problem := check_tracking_uri(where, recorded, recorded=True):
            raise PlaceError([f"{problem}; or pass --tracking-uri where it is now"])
        console.print(f"run {args.target!r} was recorded in {redact(recorded)}: read there")
        uri = recorded
    problems = [
        check_tracking_uri("--tracking-uri", uri, recorded=True),
        check_folder("--out", out),
    ]
    if any(problems):
        raise PlaceError([p for p in problems if p])
    from mlflow.tracking import MlflowClient

    from rayacc.tracking.lookup import single_run

    client = MlflowClient(uri)
    run = single_run(client, args.target)
    if run is not None:
        from rayacc.tracking.run_report import build_run_report, write_run_report

        one = build_run_report(client, run)
        for line in one.lines():
            console.print(line)
        files = write_run_report(one, out)
        console.print(f"wrote {', '.join(str(f) for f in files)}")
        return 0
    report = build_report(uri, args.target)
    _print_report(console, report)
    files = write_report(report, out, tracking_uri=uri)
    console.print(
        f"wrote {', '.join(str(f) for f in files)} (also artifacts of run {report.parent_run_id})"
    )
    return 0


def _recorded_elsewhere(target: str, uri: str) -> str | None:
    """The store the run `target` of ./rayacc_runs was recorded in, where it is not `uri`."""
    from rayacc.driver.runs import default_storage, recorded_store

    recorded = recorded_store(default_storage(), target)
    return recorded if recorded and recorded != uri else None
