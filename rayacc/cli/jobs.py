"""`rayacc submit` and `rayacc jobs`: the Ray Jobs API."""

from __future__ import annotations

import argparse


def cmd_submit(args: argparse.Namespace) -> int:
    from rayacc.driver.jobs import submit

    return submit(args.job, args.overrides, args.address, args.follow, resume=args.resume)


def cmd_jobs(args: argparse.Namespace) -> int:
    from rayacc.driver.jobs import jobs_command

    return jobs_command(args.action, args.job_id, args.address, getattr(args, "follow", False))
