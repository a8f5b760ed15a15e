"""The `rayacc` command. User mistakes exit 2 with a message that names the field or file and
the fix; no traceback."""

from __future__ import annotations

import argparse
import sys

from rayacc.config import ConfigError, TrainConfig

EXIT_USER_ERROR = 2


def _load(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig.from_yaml(args.config, overrides=args.overrides)


def cmd_plan(args: argparse.Namespace) -> int:
    """Prints the resolved batch plan and effective LR of a config, without running anything."""
    from rayacc.batch_plan import resolve_batch_plan
    from rayacc.engine.lr import effective_lr

    cfg = _load(args)
    plan = resolve_batch_plan(
        num_workers=cfg.scaling.num_workers,
        global_batch_size=cfg.batch.global_batch_size,
        micro_batch_size=cfg.batch.micro_batch_size,
        grad_accum_steps=cfg.batch.grad_accum_steps,
    )
    lr = effective_lr(
        cfg.optim.lr, plan.global_batch_size, cfg.optim.base_batch_size, cfg.optim.lr_scaling
    )
    base = cfg.optim.base_batch_size or plan.global_batch_size
    print(plan.describe())
    print(
        f"effective LR {lr:.6g} = {cfg.optim.lr:g} × "
        f"{cfg.optim.lr_scaling}({plan.global_batch_size}/{base})"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rayacc", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument("-c", "--config", required=True, help="job spec YAML, e.g. jobs/digits.yaml")
        p.add_argument(
            "overrides",
            nargs="*",
            metavar="key.path=value",
            help="config overrides, values parsed as YAML",
        )

    p = sub.add_parser("plan", help="show the batch plan and effective LR of a config")
    with_config(p)
    p.set_defaults(func=cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"rayacc: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
