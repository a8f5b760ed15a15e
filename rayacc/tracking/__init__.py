"""Run tracking: the contract params, an MLflow sink written by one process only, and the MLflow
run of a fit as an observer of its events and step records."""

from rayacc.tracking.mlflow_sink import (
    MlflowSink,
    TrackingTarget,
    default_tracking_uri,
    tracking_target,
)
from rayacc.tracking.params import contract_params
from rayacc.tracking.run import RunIdentity, TrackedRun, open_tracking

__all__ = [
    "MlflowSink",
    "RunIdentity",
    "TrackedRun",
    "TrackingTarget",
    "contract_params",
    "default_tracking_uri",
    "open_tracking",
    "tracking_target",
]
