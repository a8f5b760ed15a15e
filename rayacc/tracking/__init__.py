"""Run tracking: the contract params, and an MLflow sink written by one process only."""

from rayacc.tracking.mlflow_sink import MlflowSink, default_tracking_uri
from rayacc.tracking.params import contract_params

__all__ = ["MlflowSink", "contract_params", "default_tracking_uri"]
