"""The MLflow record of a `rayacc plan --search`: one run (tag `rayacc.kind=plan`) holding the
table, PLAN.yaml and the search's figures."""

from __future__ import annotations

from typing import Any

from rayacc.config import TrainConfig
from rayacc.tracking.mlflow_sink import MlflowSink, tracking_target

__all__ = ["record_plan"]


def record_plan(
    cfg: TrainConfig, run_name: str, params: dict[str, Any], table: str, plan_yaml: str
) -> tuple[str | None, str]:
    """(MLflow run id or None when tracking is off or the store is away, tracking URI)."""
    target = tracking_target(cfg.tracking.tracking_uri, cfg.tracking.experiment)
    uri = target.uri
    if not cfg.tracking.enabled:
        return None, uri
    sink = MlflowSink(uri, target.experiment, run_name)
    if not sink.active:
        return None, uri
    sink.log_params(params)
    sink.set_tags({"rayacc.kind": "plan"})
    sink.log_text(table, "plan/table.txt")
    sink.log_text(plan_yaml, "plan/PLAN.yaml")
    sink.finish()
    return sink.run_id, uri
