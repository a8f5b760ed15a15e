"""`rayacc plan --search` as the driver runs it: the data checked, Ray joined, a calibration
group measuring the best candidates of the planner's prior within the time budget, PLAN.yaml
written and the plan recorded in MLflow. The command prints what it returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rayacc.config import TrainConfig
from rayacc.planner.planfile import PlanFile
from rayacc.planner.search import SearchResult

__all__ = ["PlanSearch", "cluster_holds", "plan_search"]


@dataclass
class PlanSearch:
    """What a search found and where it went."""

    result: SearchResult
    """Every candidate's row, the chosen one, the timings."""
    plan: PlanFile
    token_items: bool
    run_id: str | None
    """The MLflow run that records the plan (None with tracking off)."""
    tracking_uri: str | None


def cluster_holds(cfg: TrainConfig) -> int:
    """How many of the run's workers the live nodes of the joined Ray can hold at once."""
    import ray

    from rayacc.driver.prelaunch import workers_that_fit

    alive = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive", True)]
    return workers_that_fit(alive, cfg.scaling.worker_needs())


def node_holds(cfg: TrainConfig) -> int | None:
    """The most of the run's workers one live node of the joined Ray holds (None: no node
    holds one)."""
    import ray

    from rayacc.driver.prelaunch import workers_that_fit

    holds = [
        workers_that_fit([n.get("Resources", {})], cfg.scaling.worker_needs())
        for n in ray.nodes()
        if n.get("Alive", True)
    ]
    return max(holds, default=0) or None


def plan_search(
    cfg: TrainConfig,
    *,
    budget_s: float,
    top: int,
    out: Path,
    name: str,
    on_ready: Callable[[], None],
    say: Callable[[str], None],
) -> PlanSearch:
    """Runs the search for `cfg` and writes its plan to `out` (`name`: the MLflow run's);
    `on_ready` is called once the data is checked and Ray is joined, `say` with each line of
    the search's progress."""
    from rayacc.driver.calibrate import CalibrationGroup, sample_rows
    from rayacc.driver.fit import ensure_ray
    from rayacc.driver.prelaunch import prepare
    from rayacc.driver.runs import default_storage
    from rayacc.planner.search import format_table, search
    from rayacc.tracking.plan_record import record_plan

    prep = prepare(cfg)
    ensure_ray(cfg.scaling)
    on_ready()
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
            cluster_holds=cluster_holds(cfg),
            node_holds=node_holds(cfg),
            say=say,
        )
    finally:
        group.cleanup()
    token_items = prep.info.format == "tokens"
    plan = result.plan_file(cfg)
    plan.write(out)
    run_id, uri = record_plan(
        cfg,
        name,
        {
            "global_batch_size": prep.split.global_batch_size,
            "chosen": result.chosen.candidate.label,
            "candidates": len(result.rows),
            "measured": len(result.measured),
            "budget_s": budget_s,
            "top": top,
        },
        "\n".join(format_table(result, token_items)),
        plan.to_yaml(),
    )
    return PlanSearch(result, plan, token_items, run_id, uri)
