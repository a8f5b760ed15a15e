"""`rayacc runs` and `rayacc sample`: a storage path's runs, and text from a checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rayacc.cli.common import (
    _console,
)
from rayacc.redact import redact


def cmd_runs(args: argparse.Namespace) -> int:
    """Lists the runs of a storage path, oldest first."""
    from rich.measure import Measurement
    from rich.table import Table

    from rayacc.data.common import DataError
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
        # a name is what `--resume run.name=NAME` takes, an id what MLflow finds: whole
        table.add_column(column, no_wrap=column in ("name", "MLflow run"))
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
            f"{r.status} ({r.kind} run)" if r.kind else r.status,
        )
    # wider than the terminal rather than cut: the terminal wraps what it cannot show
    natural = Measurement.get(console, console.options.update_width(1 << 14), table).maximum
    width, console.width = console.width, max(console.width, natural)
    console.print(table, crop=False)
    console.width = width
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
        base=args.base,
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


def cmd_export(args: argparse.Namespace) -> int:
    from rayacc.driver.export import export_model

    done = export_model(
        args.target,
        args.out,
        fmt=args.format,
        storage=args.storage,
        factory=args.factory,
        base=args.base,
        merge=args.merge,
    )
    for note in done.passed_over:
        print(f"rayacc: passed over {redact(note)}", file=sys.stderr)
    print(f"wrote {done.out}: {done.what}, from {redact(done.checkpoint)}")
    if args.format == "hf" or args.merge:
        print(f"  load it: transformers.AutoModelForCausalLM.from_pretrained({str(done.out)!r})")
    elif args.format == "peft":
        print(f"  load it: peft.PeftModel.from_pretrained(base_model, {str(done.out)!r})")
    return 0
