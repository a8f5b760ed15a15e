"""The command line: every command, flag and argument, each value with its kind."""

from __future__ import annotations

import argparse
from importlib.metadata import version

from rayacc.cli.data import INSTRUCT_COUNTS, OWN_TEXT_FLAGS, SEQ_LEN, cmd_data_prepare
from rayacc.cli.jobs import cmd_jobs, cmd_submit
from rayacc.cli.plan import cmd_plan
from rayacc.cli.runs import cmd_export, cmd_runs, cmd_sample
from rayacc.cli.sweep import cmd_report, cmd_sweep
from rayacc.cli.train import cmd_train, cmd_verify
from rayacc.driver.export import EXPORT_FORMATS


def build_parser() -> argparse.ArgumentParser:
    from rayacc.driver.arguments import (
        Address,
        ExistingFile,
        ExistingPath,
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

    parser = argparse.ArgumentParser(
        prog="rayacc",
        description="Train PyTorch models on Ray with data parallelism and gradient "
        "accumulation: one global batch, the step one process would take on it.",
    )
    # the installed package's (pyproject.toml's) version
    parser.add_argument("--version", action="version", version=f"rayacc {version('rayacc')}")
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

    def checkpoint_to_read(p: argparse.ArgumentParser) -> None:
        """What a command that reads a run's weights (sample, export) is given: the checkpoint,
        where a run name is found, and the factory a user's model is rebuilt with."""
        p.add_argument(
            "target",
            metavar="RUN_OR_CHECKPOINT",
            type=Name("a checkpoint folder, a run's folder, a run name or its MLflow run id"),
            help="a checkpoint folder, a run's folder (its latest checkpoint), a run name or the "
            "MLflow run id its summary printed",
        )
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
            help="the model factory a user factory model's checkpoint is rebuilt with (a "
            "checkpoint never names code to run on its own word)",
        )
        p.add_argument(
            "--base",
            type=ExistingPath("the weights folder a LoRA run started from"),
            default=None,
            metavar="DIR",
            help="a LoRA run over model.hf.weights: that base's folder (its checkpoints hold "
            "the adapters only; checked against the run's record of the base)",
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
        "target",
        metavar="EXPERIMENT_OR_RUN",
        type=Name("an experiment name, a sweep's name, a run's name or its MLflow id"),
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
    checkpoint_to_read(p)
    p.add_argument(
        "--prompt", type=Text(), default=None, help="text to continue (default: a line break)"
    )
    p.add_argument("--tokens", type=Number(int, 0), default=200, help="tokens to generate")
    p.add_argument(
        "--temperature", type=Number(float, 0), default=0.8, help="0 takes the likeliest token"
    )
    p.add_argument("--top-k", type=Number(int, 1), default=50, help="sample among the k likeliest")
    p.add_argument("--seed", type=Number(int, 0), default=0)
    p.set_defaults(func=cmd_sample)

    p = sub.add_parser(
        "export",
        help="write a checkpoint's weights for transformers (from_pretrained) or as safetensors",
    )
    checkpoint_to_read(p)
    p.add_argument(
        "--out",
        required=True,
        type=Folder("--out", whole=True),
        help="a new (or empty) folder to write",
    )
    p.add_argument(
        "--format",
        choices=EXPORT_FORMATS,
        default="hf",
        help="hf: a folder transformers loads with from_pretrained (hf and gpt models); "
        "safetensors: the weights under rayacc's names (any model); peft: a LoRA run's adapter "
        "folder (PeftModel.from_pretrained on the base)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="with --format peft: the adapters folded into the base, as a from_pretrained folder",
    )
    p.set_defaults(func=cmd_export)

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
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue run.name on the cluster as `rayacc train --resume` does (the run's "
        "started overrides kept, those given now over them)",
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
        type=Folder("--out", whole=True),
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
        "--seq-len",
        type=Number(int, 1),
        default=None,
        help=f"tokens per sample (rows hold +1); default: the job's data.seq_len with -c, else "
        f"{SEQ_LEN}",
    )
    p.add_argument(
        "-c",
        "--config",
        type=ExistingPath("a job's YAML config"),
        default=None,
        help="the job that will train on the data: --seq-len defaults to its data.seq_len",
    )
    own = OWN_TEXT_FLAGS
    p.add_argument(
        "--tokenizer",
        type=ExistingPath("a tokenizer.json, or a transformers tokenizer folder"),
        default=own["tokenizer"],
        help="a tokenizer.json, or (--instruct) a transformers tokenizer folder whose chat "
        "template renders messages (default: byte-level, 257 ids)",
    )
    p.add_argument(
        "--instruct",
        action="store_true",
        help='JSONL of {"prompt", "completion"} or {"messages": [{"role", "content"}, …]}: '
        "tokens and a loss_mask counting the answers",
    )
    p.add_argument(
        "--count",
        choices=INSTRUCT_COUNTS,
        default=own["count"],
        help="--instruct: the tokens that count as targets (answers: completions and "
        "assistant turns)",
    )
    p.add_argument(
        "--pack",
        action="store_true",
        help="--instruct: whole examples packed into rows of --seq-len + 1 tokens, each "
        "attending to itself only (a documents column); default one example a row",
    )
    p.add_argument(
        "--skip-empty",
        action="store_true",
        help="--instruct: skip an example with no counted token (default: refuse it)",
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
    _say_defaults(parser)
    return parser


def _say_defaults(parser: argparse.ArgumentParser) -> None:
    """Every flag that has a default says it in its help, a command added later's too."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _say_defaults(child)
            continue
        shown = action.default not in (None, False, argparse.SUPPRESS)
        if shown and action.option_strings and "%(default)" not in (action.help or ""):
            action.help = f"{action.help + ' ' if action.help else ''}(default: %(default)s)"


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
