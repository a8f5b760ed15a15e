"""`rayacc plan`: the batch split and LR of a config; with --search, the calibrated search."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rayacc.cli.common import (
    _console_owns_ray_output,
    _load,
)
from rayacc.config import TrainConfig
from rayacc.redact import redact


def cmd_plan(args: argparse.Namespace) -> int:
    """Prints the resolved batch split and effective LR of a config, without running anything."""
    from rayacc.driver.prelaunch import check
    from rayacc.run.quantities import (
        elastic_summary,
        lr_explanation,
        phases_summary,
        worker_splits,
    )

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
        print(elastic_summary(cfg, worker_splits(cfg)))
    print(lr_explanation(cfg, split))
    for line in phases_summary(cfg):
        print(line)
    if args.memory:
        _print_memory(cfg, split)
    return 0


def _plan_search(args: argparse.Namespace, cfg: TrainConfig) -> int:
    """`plan --search`: the search (driver/plan_search.py), then its table and where the plan
    went."""
    from rayacc.driver.places import PlaceError, check_folder
    from rayacc.driver.plan_search import plan_search
    from rayacc.planner.search import format_table

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
    found = plan_search(
        cfg,
        budget_s=budget_s,
        top=top,
        out=out,
        name=f"plan {Path(args.config).stem}",
        on_ready=lambda: print(
            f"rayacc plan --search {args.config} (time budget {budget_s:g} s, top {top})"
        ),
        say=lambda line: print(f"  {line}"),
    )
    result = found.result
    for line in format_table(result, found.token_items, limit=10):
        print(f"  {line}", flush=False)
    mem_err, time_err = result.median_errors()
    if mem_err is not None:
        print(
            f"  median error of the prior over {len(result.measured)} measured: memory "
            f"{100 * mem_err:.1f}%, step time {100 * time_err:.1f}%"
        )
    for line in result.skipped:
        print(f"  skipped: {line}")
    chosen = result.chosen
    how = "measured" if chosen.measured_ok else "predicted (none could be measured)"
    print(f"chosen: {chosen.candidate.label}, fastest {how}")
    print(f"  plan written to {out}; run it: rayacc train -c {args.config} --plan {out}")
    t = result.timings
    print(
        f"  planning took {t['total_s']:.0f} s (profile {t['profile_s']:.0f} s, calibration "
        f"{t['calibrate_s']:.0f} s, {result.groups_started} worker group(s))"
    )
    if found.run_id:
        print(
            f"  MLflow run {found.run_id} in {redact(found.tracking_uri)} (artifacts "
            "plan/table.txt, plan/PLAN.yaml)"
        )
    return 0


def _print_memory(cfg, split) -> None:
    """Estimated memory per rank for each strategy (reads the data's description and builds
    the model on the meta device: no weights are allocated)."""
    from rayacc.driver.prelaunch import prepare
    from rayacc.run.quantities import memory_per_rank

    prep = prepare(cfg)
    micro = cfg.batch.fixed_micro_batch_size
    trainable = prep.trainable_parameters
    adapters = "" if trainable is None else f" of which {trainable:,} train (LoRA)"
    mesh = cfg.mesh
    tp, keep = mesh.tensor, 1.0
    if tp > 1:
        from rayacc.models import build_on_meta
        from rayacc.planner.search import tensor_plan

        # what the model's plan splits: a rank holds and computes its share of those layers
        keep = tensor_plan(build_on_meta(cfg, prep.info), 1, 4).keep(tp)
    layout = (
        f" in tensor-parallel groups of {tp}: each rank {keep:.0%} of the model" if tp > 1 else ""
    )
    pp, held = mesh.pipeline, f"one micro-batch of {micro or '?'}"
    if pp > 1:
        from rayacc.models import build_on_meta
        from rayacc.planner.search import pipeline_share
        from rayacc.run.quantities import pipeline_in_flight

        keep = pipeline_share(build_on_meta(cfg, prep.info), mesh)
        layout = f" in pipelines of {pp} stages: the fullest rank {keep:.0%} of the model"
        in_flight = pipeline_in_flight(cfg, split.num_workers)
        held = f"{in_flight} micro-batches of {micro} (the schedule's in flight)"
    print(
        f"memory per rank, MiB (estimate; {prep.num_parameters:,} parameters{adapters}, fp32, "
        f"{split.num_workers} workers{layout}, activations of {held})"
    )
    width = 24 if tp == 1 and pp == 1 else 30
    print(f"  {'strategy':{width}} {'params':>9} {'grads':>9} {'optimizer':>9} {'activations':>11}")
    for label, params, grads, optim, acts in memory_per_rank(
        cfg, prep.info, prep.num_parameters, split.num_workers, trainable, keep
    ):
        act = f"{acts:11.1f}" if acts is not None else f"{'n/a':>11}"
        print(f"  {label:{width}} {params:9.1f} {grads:9.1f} {optim:9.1f} {act}")
