"""The `rayacc` command. User mistakes exit 2 with a message that names the field or file and
the fix; no traceback."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rayacc import env
from rayacc.config import ConfigError, TrainConfig
from rayacc.redact import redact

EXIT_USER_ERROR = 2
REPORT_OUT = "rayacc_report"
"""Where `rayacc report` writes without --out."""


def _load(args: argparse.Namespace) -> TrainConfig:
    """The job file with the command line's overrides, and those a submitted job received in
    its environment (`jobs.SECRET_OVERRIDES`: the ones that carry credentials)."""
    import json

    from rayacc.driver.jobs import SECRET_OVERRIDES

    hidden = json.loads(os.environ.get(SECRET_OVERRIDES) or "[]")
    overrides = [*args.overrides, *hidden]
    if getattr(args, "plan", None):
        from rayacc.planner.planfile import PlanFile

        plan = PlanFile.read(args.plan)
        job = TrainConfig.from_yaml(args.config, overrides=overrides)
        overrides = [*plan.overrides_for(job, str(args.config)), *overrides]
    return TrainConfig.from_yaml(args.config, overrides=overrides)


def cmd_plan(args: argparse.Namespace) -> int:
    """Prints the resolved batch split and effective LR of a config, without running anything."""
    from rayacc.driver.prelaunch import check
    from rayacc.quantities import lr_explanation

    cfg = _load(args)
    if args.search:
        return _plan_search(args, cfg)
    for flag, given in (("--budget-s", args.budget_s), ("--top", args.top), ("--out", args.out)):
        if given is not None:
            print(f"rayacc: warning: {flag} is for a search; add --search", file=sys.stderr)
    check(cfg, "plan")
    split = cfg.batch_split()
    print(split.describe())
    if cfg.scaling.elastic:
        print(cfg.elastic_summary())
    print(lr_explanation(cfg, split))
    if args.memory:
        _print_memory(cfg, split)
    return 0


def _plan_search(args: argparse.Namespace, cfg: TrainConfig) -> int:
    """`plan --search`: the calibrated search (rayacc/planner), its table, PLAN.yaml and the
    MLflow record."""
    from pathlib import Path

    from rayacc.driver.calibrate import CalibrationGroup, sample_rows
    from rayacc.driver.fit import ensure_ray
    from rayacc.driver.places import PlaceError, check_folder
    from rayacc.driver.prelaunch import prepare
    from rayacc.driver.runs import default_storage
    from rayacc.planner.search import format_table, search
    from rayacc.tracking.plan_record import record_plan

    _console_owns_ray_output()
    if args.memory:
        print(
            "rayacc: warning: --memory is the estimate without a search; ignored", file=sys.stderr
        )
    budget_s = 300.0 if args.budget_s is None else args.budget_s
    top = 3 if args.top is None else args.top
    out = Path(args.out or "PLAN.yaml")
    # where the plan goes is known now: a folder that cannot be made fails before the search
    problem = check_folder("--out", str(out.absolute().parent))
    if problem:
        raise PlaceError([problem])
    prep = prepare(cfg)
    ensure_ray(cfg)
    print(f"rayacc plan --search {args.config} (time budget {budget_s:g} s, top {top})")
    group = CalibrationGroup(
        cfg,
        prep.info,
        sample_rows(prep.info, prep.split.global_batch_size),
        default_storage(cfg.run.storage_path),
    )
    try:
        result = search(
            cfg,
            prep,
            group,
            budget_s=budget_s,
            top=top,
            cluster_holds=_cluster_holds(cfg),
            say=lambda line: print(f"  {line}"),
        )
    finally:
        group.cleanup()
    token_items = prep.info.format == "tokens"
    for line in format_table(result, token_items, limit=10):
        print(f"  {line}", flush=False)
    mem_err, time_err = result.median_errors()
    if mem_err is not None:
        print(
            f"  median error of the prior over {len(result.measured)} measured: memory "
            f"{100 * mem_err:.1f}%, step time {100 * time_err:.1f}%"
        )
    for line in result.skipped:
        print(f"  skipped: {line}")
    plan = result.plan_file(cfg)
    plan.write(out)
    chosen = result.chosen
    how = "measured" if chosen.measured_ok else "predicted (none could be measured)"
    print(f"chosen: {chosen.candidate.label}, fastest {how}")
    print(f"  plan written to {out}; run it: rayacc train -c {args.config} --plan {out}")
    t = result.timings
    print(
        f"  planning took {t['total_s']:.0f} s (profile {t['profile_s']:.0f} s, calibration "
        f"{t['calibrate_s']:.0f} s, {result.groups_started} worker group(s))"
    )
    table = "\n".join(format_table(result, token_items))
    run_id, uri = record_plan(
        cfg,
        f"plan {Path(args.config).stem}",
        {
            "global_batch_size": prep.split.global_batch_size,
            "chosen": chosen.candidate.label,
            "candidates": len(result.rows),
            "measured": len(result.measured),
            "budget_s": budget_s,
            "top": top,
        },
        table,
        plan.to_yaml(),
    )
    if run_id:
        print(f"  MLflow run {run_id} in {redact(uri)} (artifacts plan/table.txt, plan/PLAN.yaml)")
    return 0


def _cluster_holds(cfg: TrainConfig) -> int:
    import ray

    from rayacc.driver.prelaunch import worker_needs, workers_that_fit

    alive = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive", True)]
    return workers_that_fit(alive, worker_needs(cfg))


def _print_memory(cfg, split) -> None:
    """Estimated memory per rank for each strategy (reads the data's description and builds
    the model on the meta device: no weights are allocated)."""
    from rayacc.driver.prelaunch import prepare
    from rayacc.quantities import memory_per_rank

    prep = prepare(cfg)
    micro = cfg.batch.fixed_micro_batch_size
    print(
        f"memory per rank, MiB (estimate; {prep.num_parameters:,} parameters, fp32, "
        f"{split.num_workers} workers, activations of one micro-batch of {micro or '?'})"
    )
    print(f"  {'strategy':24} {'params':>9} {'grads':>9} {'optimizer':>9} {'activations':>11}")
    for label, params, grads, optim, acts in memory_per_rank(
        cfg, prep.info, prep.num_parameters, split.num_workers
    ):
        act = f"{acts:11.1f}" if acts is not None else f"{'n/a':>11}"
        print(f"  {label:24} {params:9.1f} {grads:9.1f} {optim:9.1f} {act}")


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
    if not env.verbose():
        # a sweep's console is rayacc's trial lines: Tune's own reporter (a config table,
        # where its results are, a TensorBoard hint) stays quiet at verbose=0 only in its
        # classic engine, and its automatic TensorBoard/CSV/JSON loggers write files nobody reads
        os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
        os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")


def _user_error_types() -> tuple[type[BaseException], ...]:
    from rayacc.checkpoint.reader import CheckpointError
    from rayacc.config.batch_split import BatchSplitError
    from rayacc.data.sources import DataError
    from rayacc.driver.jobs import SubmitError
    from rayacc.driver.places import PlaceError
    from rayacc.driver.prelaunch import ResourceError
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
    )


def cmd_train(args: argparse.Namespace) -> int:
    """Runs a training job and prints its summary."""
    import time

    t_main = time.time()
    from rayacc.driver.fit import TrainingError, ensure_ray, fit
    from rayacc.driver.prelaunch import locate, prepare
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
    cfg = _load(args)
    # every user mistake surfaces here, before Ray starts
    prep = prepare(cfg)
    location = locate(cfg, args.resume, prep.spec.identity)
    t_checked = time.time()
    with ThreadPoolExecutor(1, thread_name_prefix="rayacc-imports") as pool:
        # Ray's start is mostly other processes' work: the modules the fit needs next load
        # meanwhile instead of after it
        pool.submit(_import_ray_layer)
        ensure_ray(cfg)
    t_ray = time.time()
    console.print(styled(("rayacc train", "bold"), f" {args.config}"))
    if args.plan:
        console.print(f"  settings from the plan {args.plan}")
    for line in run_header(cfg, prep, redact(prep.info.path)):
        console.print(f"  {line}")
    for w in [*prep.warnings, *location.notes]:
        err.print(styled(("warning:", "yellow"), f" {w}"))

    try:
        with ProgressPrinter(console, prep.total_steps, bar=True) as display:
            result = fit(
                cfg, resume=args.resume, observers=[display], prepared=prep, location=location
            )
    except TrainingError as exc:
        err.print(styled((f"rayacc: {exc}", "red")))
        return 1
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
    from pathlib import Path

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


def cmd_sweep(args: argparse.Namespace) -> int:
    """Runs every trial of a sweep, then prints the comparison table."""
    from pathlib import Path

    from rayacc.config import SweepConfig
    from rayacc.driver.sweep import run_sweep
    from rayacc.observe.console import styled, val_parts
    from rayacc.tracking.report import build_report

    console = _console()
    _console_owns_ray_output()
    sweep, base, source = SweepConfig.from_yaml(args.config)
    from rayacc.driver.prelaunch import check

    # the base as every trial shares it: its places, data, model and batch against the data
    check(TrainConfig.model_validate(base), "run")
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
    return 0 if all(o.get("ok") for o in result.outcomes.values()) else 1


def _console():
    from rayacc.observe.console import make_console

    # tables need room: a pipe or a file gets 160 columns instead of rich's default 80
    return make_console(width=None if sys.stdout.isatty() else 160)


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
    from rayacc.tracking import default_tracking_uri
    from rayacc.tracking.report import build_report, write_report

    console = _console()
    uri = args.tracking_uri or default_tracking_uri()
    out = args.out or REPORT_OUT
    problems = [
        check_tracking_uri("--tracking-uri", uri, recorded=True),
        check_folder("--out", out),
    ]
    if any(problems):
        raise PlaceError([p for p in problems if p])
    from mlflow.tracking import MlflowClient

    from rayacc.tracking.report import single_run

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


def cmd_runs(args: argparse.Namespace) -> int:
    """Lists the runs of a storage path, oldest first."""
    from rich.table import Table

    from rayacc.data.sources import DataError
    from rayacc.driver.runs import default_storage, list_runs, storage_exists

    console = _console()
    storage = default_storage(args.storage)
    if args.storage is not None and not storage_exists(storage):
        raise DataError(
            f"--storage {redact(args.storage)}: no such folder. Fix: give the run.storage_path "
            "the runs were trained with"
        )
    runs = list_runs(storage)
    if not runs:
        console.print(f"no rayacc runs in {redact(storage)}")
        return 0
    table = Table(title=f"runs in {redact(storage)}")
    for column in ("name", "job", "model / data", "steps", "last checkpoint", "MLflow run"):
        table.add_column(column)
    table.add_column("status")
    for r in runs:
        total = r.total_steps if r.total_steps is not None else "?"
        table.add_row(
            r.name,
            r.job or "-",
            f"{r.model or '?'} / {r.data or '?'}",
            f"{r.steps_done}/{total}",
            Path(r.last_checkpoint).name if r.last_checkpoint else "-",
            r.mlflow_run_id or "-",
            r.status,
        )
    console.print(table)
    for r in runs:
        for note in r.passed_over:
            print(f"rayacc: {r.name}: passed over {redact(note)}", file=sys.stderr)
    console.print("resume one: rayacc train -c JOB --resume run.name=NAME")
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    """Text from a token model's checkpoint, on stdout (prompt, then the continuation)."""
    from rayacc.driver.sample import sample

    result = sample(
        args.target,
        prompt=args.prompt,
        tokens=args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        storage=args.storage,
        factory=args.factory,
    )
    for note in result.passed_over:
        print(f"rayacc: passed over {redact(note)}", file=sys.stderr)
    print(
        f"rayacc: {len(result.ids)} tokens from {redact(result.checkpoint)}, decoded as "
        f"{result.vocabulary.describe()}",
        file=sys.stderr,
    )
    sys.stdout.write(result.whole + "\n")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from rich.table import Table

    from rayacc.driver.verify import verify
    from rayacc.observe.console import make_console, styled

    console, err = make_console(), make_console(stderr=True)
    _console_owns_ray_output()
    cfg = _load(args)
    result = verify(cfg)
    for w in result.warnings:
        err.print(styled(("warning:", "yellow"), f" {w}"))
    split = cfg.batch_split()
    table = Table(title=f"one step of {split.describe()}, {cfg.train.precision}, vs one process")
    for col in ("parameter", "max abs diff", "rel diff ‖Δw_ray − Δw_single‖/‖Δw_single‖"):
        table.add_column(col, justify="right")
    for d in result.diffs:
        table.add_row(d.name, f"{d.max_abs:.3e}", f"{d.max_rel:.3e}")
    console.print(table)
    verdict = ("PASS", "green") if result.passed else ("FAIL", "red")
    console.print(
        styled(
            verdict,
            f": largest relative difference {result.worst.max_rel:.3e} "
            f"({result.worst.name}); tolerance {result.tolerance:g} for {cfg.train.precision}",
        )
    )
    if result.mlflow_run_id:
        console.print(f"  MLflow run {result.mlflow_run_id} tagged rayacc.verified")
    return 0 if result.passed else 1


def cmd_submit(args: argparse.Namespace) -> int:
    from rayacc.driver.jobs import submit

    return submit(args.job, args.overrides, args.address, args.follow)


def cmd_jobs(args: argparse.Namespace) -> int:
    from rayacc.driver.jobs import jobs_command

    return jobs_command(args.action, args.job_id, args.address, getattr(args, "follow", False))


OWN_TEXT_FLAGS = {
    "tokenizer": None,
    "text_field": "text",
    "rows_per_group": 64,
    "rows_per_file": 1 << 20,
    "shuffle": False,
    "seed": 0,
}
"""`rayacc data prepare` flags of the user's own text (with --out), and their defaults."""
SEQ_LEN = 128


def cmd_data_prepare(args: argparse.Namespace) -> int:
    """A bundled dataset (cached), or the user's text/JSONL files → token Parquet in --out."""
    from rayacc.data.sources import BUNDLED, DataError, describe_dataset

    if len(args.inputs) == 1 and args.inputs[0] in BUNDLED and args.out is None:
        name = args.inputs[0]
        info = describe_dataset(name, args.cache_dir, args.seq_len)
        ignored = [
            f"--{key.replace('_', '-')}"
            for key, default in OWN_TEXT_FLAGS.items()
            if getattr(args, key) != default
        ]
        if info.format != "tokens" and args.seq_len != SEQ_LEN:
            ignored.insert(0, "--seq-len")
        if ignored:
            print(
                f"rayacc: warning: {', '.join(ignored)} ignored: {name} is a bundled "
                f"{info.format} dataset (they apply to your own text files, with --out)",
                file=sys.stderr,
            )
        print(f"{name}: {info.num_rows} rows ({info.format}) at {info.path}")
        return 0
    if args.out is None:
        raise DataError(
            f"rayacc data prepare {' '.join(args.inputs)}: text or JSONL inputs need --out DIR "
            f"(a new folder for the Parquet); bundled names are {', '.join(BUNDLED)}"
        )
    from rayacc.data.prepare import prepare_corpus
    from rayacc.driver.places import PlaceError, check_folder

    if problem := check_folder("--out", args.out):
        raise PlaceError([problem])
    prepare_corpus(
        args.inputs,
        args.out,
        seq_len=args.seq_len,
        tokenizer=args.tokenizer,
        text_field=args.text_field,
        rows_per_group=args.rows_per_group,
        rows_per_file=args.rows_per_file,
        shuffle=args.shuffle,
        seed=args.seed,
    )
    print(f"train on it: rayacc train -c JOB.yaml data.source={args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from rayacc.driver.arguments import (
        Address,
        ExistingFile,
        Factory,
        Folder,
        Name,
        NewFile,
        Number,
        Override,
        Storage,
        Text,
        TrackingUri,
    )

    parser = argparse.ArgumentParser(prog="rayacc", description=__doc__)
    job_file = ExistingFile("the job's YAML file, e.g. jobs/digits.yaml")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "-c",
            "--config",
            required=True,
            type=job_file,
            help="job spec YAML, e.g. jobs/digits.yaml",
        )
        p.add_argument(
            "overrides",
            nargs="*",
            type=Override(),
            metavar="key.path=value",
            help="config overrides, values parsed as YAML",
        )

    p = sub.add_parser(
        "train", help="run a training job on Ray (local Ray unless RAY_ADDRESS is set)"
    )
    with_config(p)
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue run.name (or the latest run) from its latest checkpoint",
    )
    p.add_argument(
        "--plan",
        metavar="PLAN.yaml",
        type=ExistingFile("the PLAN.yaml `rayacc plan --search` wrote"),
        default=None,
        help="run the settings `rayacc plan --search` chose (overrides given here still win)",
    )
    p.add_argument(
        "--timings",
        metavar="FILE",
        type=NewFile("--timings"),
        default=None,
        help="write when each phase of the run ended (driver and rank 0), and what it ran on, "
        "as JSON",
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "plan",
        help="show the batch split and effective LR of a config; with --search, choose workers, "
        "micro-batch, strategy and activation checkpointing by measuring",
    )
    with_config(p)
    p.add_argument(
        "--memory",
        action="store_true",
        help="also estimate memory per rank for ddp and fsdp (reads the data's description)",
    )
    p.add_argument(
        "--search",
        action="store_true",
        help="search the settings that keep the global batch: a measured profile, a prior for "
        "every candidate, then a few steps of the best on the real worker group",
    )
    p.add_argument(
        "--budget-s",
        type=Number(float, 0, above=True),
        default=None,
        help="with --search: seconds the search may take before it stops measuring (300)",
    )
    p.add_argument(
        "--top", type=Number(int, 1), default=None, help="with --search: candidates to measure (3)"
    )
    p.add_argument(
        "--out",
        type=NewFile("--out"),
        default=None,
        help="with --search: where the plan is written (PLAN.yaml)",
    )
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("sweep", help="run a sweep of accumulation settings through Ray Tune")
    p.add_argument(
        "-c",
        "--config",
        required=True,
        type=ExistingFile("the sweep's YAML file, e.g. jobs/sweep_accum.yaml"),
        help="sweep YAML, e.g. jobs/sweep_accum.yaml",
    )
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser(
        "report",
        help="compare a sweep's trials (table, CSV, plots), or show one run's course: workers, "
        "global batch and accumulation over time with its events, and its goodput",
    )
    p.add_argument(
        "target", metavar="EXPERIMENT_OR_RUN", type=Name("an experiment name or a run id")
    )
    p.add_argument(
        "--out",
        type=Folder("--out"),
        default=None,
        help="folder for the CSV and the PNGs (rayacc_report)",
    )
    p.add_argument(
        "--tracking-uri",
        type=TrackingUri("--tracking-uri"),
        default=None,
        help="default: sqlite:///<cwd>/mlflow.db",
    )
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("runs", help="list the runs of a storage path and how far each got")
    p.add_argument(
        "--storage",
        type=Storage(),
        default=None,
        help="run.storage_path of the runs (default: ./rayacc_runs)",
    )
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("sample", help="generate text from a token model's checkpoint")
    p.add_argument(
        "target",
        metavar="RUN_OR_CHECKPOINT",
        type=Name("a checkpoint folder, a run's folder or a run name"),
        help="a checkpoint folder, a run's folder (its latest checkpoint) or a run name",
    )
    p.add_argument(
        "--prompt", type=Text(), default=None, help="text to continue (default: a line break)"
    )
    p.add_argument("--tokens", type=Number(int, 0), default=200, help="tokens to generate")
    p.add_argument(
        "--temperature", type=Number(float, 0), default=0.8, help="0 takes the likeliest token"
    )
    p.add_argument("--top-k", type=Number(int, 1), default=50, help="sample among the k likeliest")
    p.add_argument("--seed", type=Number(int, 0), default=0)
    p.add_argument(
        "--storage",
        type=Storage(),
        default=None,
        help="run.storage_path of a run name (default: ./rayacc_runs)",
    )
    p.add_argument(
        "--factory",
        type=Factory(),
        default=None,
        metavar="MODULE:FUNCTION",
        help="the model factory a user factory model's checkpoint is rebuilt with (a checkpoint "
        "never names code to run on its own word)",
    )
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser("verify", help="check one accumulated step against one process")
    with_config(p)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("submit", help="submit a job spec to a Ray cluster (Ray Jobs API)")
    p.add_argument(
        "job", type=job_file, help="job spec YAML inside the project, e.g. jobs/digits.yaml"
    )
    p.add_argument("overrides", nargs="*", type=Override(), metavar="key.path=value")
    p.add_argument(
        "--address",
        type=Address(),
        default=None,
        help="Ray Jobs API, e.g. http://127.0.0.1:8265 (default: $RAY_ADDRESS)",
    )
    p.add_argument(
        "--follow", action="store_true", help="stream the logs; exit with the job's status"
    )
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("jobs", help="list, inspect, follow or stop submitted jobs")
    p.add_argument("action", choices=["list", "status", "logs", "stop"])
    p.add_argument("job_id", nargs="?", type=Name("a job id (`rayacc jobs list` shows them)"))
    p.add_argument(
        "--address", type=Address(), default=None, help="Ray Jobs API (default: $RAY_ADDRESS)"
    )
    p.add_argument("--follow", action="store_true", help="with logs: stream until the job ends")
    p.set_defaults(func=cmd_jobs)

    data = sub.add_parser("data", help="bundled datasets, and token Parquet from your own text")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    p = data_sub.add_parser(
        "prepare",
        help="prepare a bundled dataset (digits, shakespeare; cached), or tokenize text/JSONL "
        "files or folders (local or URI) into token Parquet in --out",
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="NAME_OR_FILE",
        type=Name("a bundled dataset's name, or a text/JSONL file or folder"),
    )
    p.add_argument(
        "--out",
        type=Folder("--out"),
        default=None,
        help="new folder for the Parquet (text/JSONL inputs)",
    )
    p.add_argument(
        "--cache-dir",
        type=Folder("--cache-dir"),
        default=None,
        help="bundled datasets: where they are cached",
    )
    p.add_argument(
        "--seq-len", type=Number(int, 1), default=SEQ_LEN, help="tokens per sample (rows hold +1)"
    )
    own = OWN_TEXT_FLAGS
    p.add_argument(
        "--tokenizer",
        type=ExistingFile("a tokenizer.json (Hugging Face tokenizers' format)"),
        default=own["tokenizer"],
        help="a tokenizer.json (default: byte-level, 257 ids)",
    )
    p.add_argument(
        "--text-field",
        type=Name("the JSONL field that holds the text"),
        default=own["text_field"],
        help="JSONL: the field holding the text",
    )
    p.add_argument(
        "--rows-per-group",
        type=Number(int, 1),
        default=own["rows_per_group"],
        help="Parquet row group size: at most a quarter of each rank's share of a window "
        "(global batch / workers) for about one read of each row per epoch",
    )
    p.add_argument("--rows-per-file", type=Number(int, 1), default=own["rows_per_file"])
    p.add_argument("--shuffle", action="store_true", help="shuffle all rows with Ray Data")
    p.add_argument("--seed", type=Number(int, 0), default=own["seed"], help="the shuffle's seed")
    p.set_defaults(func=cmd_data_prepare)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with `key.path=value` overrides accepted anywhere among the flags
    (argparse alone takes them only before the first flag)."""
    from rayacc.driver.arguments import Override

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    for item in extra:  # the same check argparse gives the ones before the first flag
        if problem := Override().problem(item):
            parser.error(f"argument key.path=value: {problem}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    from rayacc.observe.console import QuietRayStream
    from rayacc.redact import RedactingStream

    # the console's one boundary: every line, rayacc's or a library's (argparse's messages
    # about the command line too), loses its credentials; Ray's own records below ERROR stay
    # in Ray's log files unless RAYACC_VERBOSE=1
    streams = sys.stdout, sys.stderr
    console_stream = RedactingStream if env.verbose() else QuietRayStream
    out, err = console_stream(sys.stdout), console_stream(sys.stderr)
    sys.stdout, sys.stderr = out, err
    try:
        args = parse_args(argv)
        return args.func(args)
    except _user_error_types() as exc:
        print(f"rayacc: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("rayacc: interrupted", file=sys.stderr)
        return 130
    except Exception:
        import traceback

        traceback.print_exc()  # through the boundary, so masked too
        return 1
    finally:
        # a line left unfinished is masked whole, then the streams are the process's again
        out.release()
        err.release()
        sys.stdout, sys.stderr = streams


def run() -> None:
    """The `rayacc` command: `main`, then a quick exit. Once the command is done, everything it
    wrote is closed; stopping the local Ray it started is all that is left to do. The
    interpreter's own teardown of torch, Ray and gRPC would add about 2 s on 2 cores, so the
    process ends without it."""
    code = main()
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
