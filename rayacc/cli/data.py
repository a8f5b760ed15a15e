"""`rayacc data prepare`: bundled datasets, and token Parquet from your own text."""

from __future__ import annotations

import argparse
import sys

OWN_TEXT_FLAGS = {
    "tokenizer": None,
    "text_field": "text",
    "rows_per_group": 64,
    "rows_per_file": 1 << 20,
    "shuffle": False,
    "seed": 0,
    "instruct": False,
    "count": "answers",
    "pack": False,
    "skip_empty": False,
}
"""`rayacc data prepare` flags of the user's own text (with --out), and their defaults."""
SEQ_LEN = 128
INSTRUCT_COUNTS = ("answers", "all")
"""`--count`: `rayacc.data.instruct.COUNTS` (kept here: the parser imports no data module)."""
INSTRUCT_ONLY = ("count", "pack", "skip_empty")
TEXT_ONLY = ("text_field", "rows_per_file", "shuffle", "seed")


def cmd_data_prepare(args: argparse.Namespace) -> int:
    """A bundled dataset (cached), or the user's text/JSONL files → token Parquet in --out."""
    from rayacc.data.common import BUNDLED, DataError
    from rayacc.data.sources import describe_dataset

    if args.seq_len is None:  # the job's length where one is named, so no answer is cut short
        args.seq_len = SEQ_LEN
        if args.config is not None:
            from rayacc.config import TrainConfig

            args.seq_len = TrainConfig.from_yaml(args.config).data.seq_len

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
    from rayacc.driver.places import PlaceError, check_folder

    if problem := check_folder("--out", args.out):
        raise PlaceError([problem])
    other = TEXT_ONLY if args.instruct else INSTRUCT_ONLY
    if given := [k for k in other if getattr(args, k) != OWN_TEXT_FLAGS[k]]:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in given)
        raise DataError(
            f"{flags}: only {'without' if args.instruct else 'with'} --instruct. Fix: "
            f"{'leave them out' if args.instruct else 'add --instruct, or leave them out'}"
        )
    if args.instruct:
        from rayacc.data.instruct import prepare_instructions

        prepare_instructions(
            args.inputs,
            args.out,
            seq_len=args.seq_len,
            tokenizer=args.tokenizer,
            count=args.count,
            pack=args.pack,
            skip_empty=args.skip_empty,
            rows_per_group=args.rows_per_group,
        )
        print(f"train on it: rayacc train -c jobs/finetune_chat.yaml data.source={args.out}")
        return 0
    from rayacc.data.prepare import prepare_corpus

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
