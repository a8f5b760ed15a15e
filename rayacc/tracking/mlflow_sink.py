"""MLflow sink. One process writes (the driver); a tracking server that cannot be reached turns
tracking off with one message and training goes on. Every param, tag, text and message passes
through `redact`: credentials in a URI (`user:password@`) are never logged or printed."""

from __future__ import annotations

import math
import sys
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rayacc.redact import redact

__all__ = ["MlflowSink", "default_tracking_uri"]

_MAX_PARAMS_PER_CALL = 100
_MAX_METRICS_PER_CALL = 1000


def default_tracking_uri() -> str:
    # absolute: Ray workers and tools started elsewhere must find the same file
    return f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"


def _server_reachable(uri: str, timeout_s: float = 10.0) -> str | None:
    """None when the server answers; otherwise why not."""
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s):
            return None
    except Exception as exc:
        return str(getattr(exc, "reason", exc))


class MlflowSink:
    """Creates (or reopens) one MLflow run and logs params, per-step metrics, tags and artifacts.

    Every call is best-effort: the first failure prints one line to stderr and later calls are
    skipped, so an outage never stops training.
    """

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        run_name: str | None = None,
        run_id: str | None = None,
        parent_run_id: str | None = None,
    ):
        self.tracking_uri = tracking_uri
        self.run_id: str | None = None
        self.client: Any = None
        self.disabled_reason: str | None = None
        self._logged_steps: set[tuple[str, int]] = set()
        self.existing_tags: dict[str, str] = {}
        """The tags of a reopened run, as they were (history that later tags extend)."""
        if tracking_uri.startswith(("http://", "https://")):
            why = _server_reachable(tracking_uri)
            if why:
                self._disable(f"tracking server {tracking_uri} unreachable ({why})")
                return
        try:
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=tracking_uri)
            if run_id is not None:
                self.client.update_run(run_id, status="RUNNING")
                self.run_id = run_id
                data = self.client.get_run(run_id).data
                self.existing_tags = dict(data.tags)
                # steps the interrupted attempt already recorded are not recorded again
                for key in data.metrics:
                    for m in self.client.get_metric_history(run_id, key):
                        self._logged_steps.add((key, m.step))
                return
            exp = self.client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
            tags = {"mlflow.parentRunId": parent_run_id} if parent_run_id else None
            self.run_id = self.client.create_run(exp_id, run_name=run_name, tags=tags).info.run_id
        except Exception as exc:
            self._disable(f"MLflow at {tracking_uri} failed: {exc}")

    @property
    def active(self) -> bool:
        return self.run_id is not None and self.disabled_reason is None

    def _disable(self, reason: str) -> None:
        if self.disabled_reason is None:
            reason = redact(reason)
            self.disabled_reason = reason
            print(f"rayacc: tracking off, training goes on: {reason}", file=sys.stderr)

    def _call(self, method: str, *args, **kwargs) -> Any:
        if not self.active:
            return None
        try:
            return getattr(self.client, method)(*args, **kwargs)
        except Exception as exc:
            self._disable(f"MLflow call {method} failed: {exc}")
            return None

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, _param_str(redact(v))) for k, v in params.items()]
        for i in range(0, len(items), _MAX_PARAMS_PER_CALL):
            self._call("log_batch", self.run_id, params=items[i : i + _MAX_PARAMS_PER_CALL])

    def log_step_metrics(self, records: Iterable[dict[str, Any]]) -> None:
        """Records carry `step` and numeric metrics. A (key, step) already logged is dropped, so a
        worker group restarted from a checkpoint never records a step twice."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = []
        for rec in records:
            step = int(rec["step"])
            for key, value in rec.items():
                if key == "step" or not isinstance(value, (int, float)) or isinstance(value, bool):
                    continue
                if (key, step) in self._logged_steps or not math.isfinite(float(value)):
                    continue
                self._logged_steps.add((key, step))
                metrics.append(Metric(key, float(value), now, step))
        for i in range(0, len(metrics), _MAX_METRICS_PER_CALL):
            self._call("log_batch", self.run_id, metrics=metrics[i : i + _MAX_METRICS_PER_CALL])

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        tags = [RunTag(k, redact(str(v))) for k, v in tags.items()]
        self._call("log_batch", self.run_id, tags=tags)

    def log_artifact(self, path: str | Path) -> None:
        self._call("log_artifact", self.run_id, str(path))

    def log_text(self, text: str, name: str) -> None:
        self._call("log_text", self.run_id, redact(text), name)

    def finish(self, status: str = "FINISHED") -> None:
        self._call("set_terminated", self.run_id, status)


def _param_str(value: Any) -> str:
    text = "null" if value is None else str(value)
    # MLflow caps a param value at 6000 characters
    return text if len(text) <= 6000 else text[:5997] + "..."
