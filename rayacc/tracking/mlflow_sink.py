"""MLflow sink. One process writes (the driver); a tracking server that cannot be reached turns
tracking off with one message and training goes on. Every param, tag, text and message passes
through `redact`: credentials in a URI (`user:password@`) are never logged or printed."""

from __future__ import annotations

import math
import queue
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayacc.env import FIELD_VARIABLES, umask_modes
from rayacc.observe.ranks import TIME_KEY
from rayacc.redact import redact
from rayacc.tracking.ui_view import VIEW_TAG, saved_view

__all__ = [
    "MlflowSink",
    "TrackingTarget",
    "default_tracking_uri",
    "log_files",
    "tag_run",
    "tracking_target",
]

_MAX_PARAMS_PER_CALL = 100
_MAX_METRICS_PER_CALL = 1000


URI_ENV, EXPERIMENT_ENV = (
    next(v for v, f in FIELD_VARIABLES.items() if f == field)
    for field in ("tracking.tracking_uri", "tracking.experiment")
)
"""MLflow's own variables: what a user of MLflow has set, used where the config says null
(checked as those fields: `env.FIELD_VARIABLES`)."""
DEFAULT_EXPERIMENT = "rayacc"
EXPERIMENT_KIND, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"
"""The experiment tag MLflow 3's UI chooses its view by, and its model-training value."""


def default_tracking_uri() -> str:
    """`MLFLOW_TRACKING_URI` where it is set, else a SQLite file in the working directory."""
    import os

    # absolute: Ray workers and tools started elsewhere must find the same file
    return os.environ.get(URI_ENV) or f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"


@dataclass(frozen=True)
class TrackingTarget:
    """Where a run is recorded, and what chose each part (the config's field, MLflow's
    variable, or rayacc's default)."""

    uri: str
    experiment: str
    uri_from: str
    experiment_from: str

    def describe(self) -> str:
        """The header's line (the URI redacted by the caller's stream)."""
        return (
            f"tracking: MLflow {self.uri} ({self.uri_from}), experiment {self.experiment!r} "
            f"({self.experiment_from})"
        )


def tracking_target(uri: str | None, experiment: str | None) -> TrackingTarget:
    """The config's `tracking.tracking_uri` and `tracking.experiment` where set; else
    `MLFLOW_TRACKING_URI` and `MLFLOW_EXPERIMENT_NAME`; else rayacc's defaults."""
    import os

    def pick(value: str | None, field: str, env: str, default) -> tuple[str, str]:
        if value:
            return value, field
        if os.environ.get(env):
            return os.environ[env], env
        # the default asked for only when used (it reads the working directory)
        return default(), "default"

    u, u_from = pick(uri, "tracking.tracking_uri", URI_ENV, default_tracking_uri)
    e, e_from = pick(experiment, "tracking.experiment", EXPERIMENT_ENV, lambda: DEFAULT_EXPERIMENT)
    return TrackingTarget(u, e, u_from, e_from)


def _server_reachable(uri: str) -> str | None:
    """None when the server answers; otherwise why not. Asks as MLflow's client does
    (requests, within its MLFLOW_HTTP_REQUEST_TIMEOUT): basic auth from the URI's
    `user:password@`, else MLflow's variables (MLFLOW_TRACKING_TOKEN, or
    MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD)."""
    import os

    import requests

    try:
        timeout_s = float(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT", "10"))
    except ValueError:
        timeout_s = 10.0

    headers, auth = {}, None
    if os.environ.get("MLFLOW_TRACKING_TOKEN"):
        headers["Authorization"] = f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}"
    elif os.environ.get("MLFLOW_TRACKING_USERNAME") and os.environ.get("MLFLOW_TRACKING_PASSWORD"):
        auth = (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"])
    try:
        # a URI's userinfo becomes basic auth in requests (urllib cannot parse it at all)
        answer = requests.get(
            uri.rstrip("/") + "/health", headers=headers, auth=auth, timeout=timeout_s
        )
    except requests.RequestException as exc:
        return str(exc)
    if answer.status_code in (401, 403):
        return f"the server refused the credentials (HTTP {answer.status_code})"
    return None if answer.ok else f"HTTP {answer.status_code} from /health"


def _slow(why: str) -> bool:
    """Whether a failure is a server too slow to answer yet (read timeout, 502–504), not
    one absent or refusing (connection refused, 401/403, a rejected call)."""
    low = why.lower()
    return "read timed out" in low or any(f"http {code}" in low for code in (502, 503, 504))


class MlflowSink:
    """Creates (or reopens) one MLflow run and logs params, per-step metrics, tags and artifacts.

    A store that cannot be reached when the run opens turns tracking off with one message.
    After that, writes never block the caller: they queue, in order, for a writer thread. When
    the server goes away the writer prints one line, keeps the queue and retries; when it comes
    back it says so and writes what waited. `finish` waits a bounded time for the queue and
    says how many records could not be written. A call the server answers with an error (a
    rejected value) is reported once and dropped; it is not retried.
    """

    RETRY_INTERVAL_S = 2.0
    """How often the writer tries again while the server is away."""
    OPEN_WITHIN_S = 60.0
    """How long a server that answers too slowly (a read timeout, a 5xx while it starts) is
    asked again to open the run before tracking is turned off."""

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        run_name: str | None = None,
        run_id: str | None = None,
        parent_run_id: str | None = None,
    ):
        self.tracking_uri = tracking_uri
        # the config refuses credentials in names; a name from elsewhere is masked all the same
        experiment, run_name = redact(experiment), redact(run_name)
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.client: Any = None
        self.disabled_reason: str | None = None
        self._logged_steps: set[tuple[str, int]] = set()
        self.existing_tags: dict[str, str] = {}
        """The tags of a reopened run, as they were (history that later tags extend)."""
        self._queue: queue.Queue[tuple[str, tuple[Any, ...], int] | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._away_since: float | None = None
        self._in_flight = 0
        self._reported: set[str] = set()
        # a server that answers slowly (one just started: its first request builds its
        # store) is asked again within OPEN_WITHIN_S; one that refuses or is not there is not
        deadline = time.monotonic() + self.OPEN_WITHIN_S
        while True:
            slow = self._open(tracking_uri, experiment, run_name, run_id, parent_run_id)
            if slow is None:
                return
            if time.monotonic() + self.RETRY_INTERVAL_S > deadline:
                self._disable(slow)
                return
            time.sleep(self.RETRY_INTERVAL_S)

    def _open(self, tracking_uri, experiment, run_name, run_id, parent_run_id) -> str | None:
        """Opens the run (or turns tracking off); a slow server's why, to ask again."""
        if tracking_uri.startswith(("http://", "https://")):
            why = _server_reachable(tracking_uri)
            if why:
                reason = f"tracking server {tracking_uri} unreachable ({why})"
                if _slow(why):
                    return reason
                self._disable(reason)
                return None
        try:
            from mlflow.tracking import MlflowClient

            from rayacc.tracking.sqlite_store import prepare_sqlite_store

            prepare_sqlite_store(tracking_uri)
            self.client = MlflowClient(tracking_uri=tracking_uri)
            if run_id is not None:
                self.client.update_run(run_id, status="RUNNING")
                self.run_id = run_id
                reopened = self.client.get_run(run_id)
                self.experiment_id = reopened.info.experiment_id
                data = reopened.data
                self.existing_tags = dict(data.tags)
                # steps the interrupted attempt already recorded are not recorded again
                for key in data.metrics:
                    for m in self.client.get_metric_history(run_id, key):
                        self._logged_steps.add((key, m.step))
                return
            exp = self.client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
            if exp is None or EXPERIMENT_KIND not in exp.tags:
                # MLflow 3's UI opens an experiment of unknown kind in its GenAI view (traces,
                # judges); a training run's is the model-training one. A kind already set
                # (by the user, in the UI) stays.
                self.client.set_experiment_tag(exp_id, EXPERIMENT_KIND, MODEL_TRAINING)
            if exp is None or VIEW_TAG not in exp.tags:  # one the user changed stays
                view = saved_view(int(time.time() * 1000))
                self.client.set_experiment_tag(exp_id, VIEW_TAG, view)
            self.experiment_id = exp_id
            tags = {"mlflow.parentRunId": parent_run_id} if parent_run_id else None
            self.run_id = self.client.create_run(exp_id, run_name=run_name, tags=tags).info.run_id
        except Exception as exc:
            reason = f"MLflow at {tracking_uri} failed: {exc}"
            if _slow(str(exc)):
                return reason
            self._disable(reason)
        return None

    @property
    def active(self) -> bool:
        return self.run_id is not None and self.disabled_reason is None

    def _disable(self, reason: str) -> None:
        if self.disabled_reason is None:
            reason = redact(reason)
            self.disabled_reason = reason
            print(f"rayacc: tracking off, training goes on: {reason}", file=sys.stderr)

    def _call(self, method: str, *args, records: int = 1) -> None:
        """Queues `client.method(run_id, *args)` for the writer thread (`records`: how many
        records it carries, for the count of what could not be written)."""
        if not self.active:
            return
        if self._writer is None:
            self._writer = threading.Thread(target=self._write, name="rayacc-mlflow", daemon=True)
            self._writer.start()
        self._queue.put((method, args, records))

    def _write(self) -> None:
        while (item := self._queue.get()) is not None:
            method, args, self._in_flight = item
            while not self._try(method, args):
                time.sleep(self.RETRY_INTERVAL_S)
            self._in_flight = 0
            self._queue.task_done()
        self._queue.task_done()

    def _try(self, method: str, args: tuple[Any, ...]) -> bool:
        """True when the call is done with (written, or rejected by the server and dropped);
        False while the server is away."""
        from mlflow.exceptions import RestException

        try:
            if method == "_model":
                self._model_now(*args)
            else:
                getattr(self.client, method)(self.run_id, *args)
        except RestException as exc:  # the server answered: retrying would not help
            if method not in self._reported:
                self._reported.add(method)
                print(f"rayacc: MLflow rejected {method}: {redact(str(exc))}", file=sys.stderr)
            return True
        except Exception as exc:
            if self._away_since is None:
                self._away_since = time.monotonic()
                print(
                    f"rayacc: tracking server {redact(self.tracking_uri)} unreachable "
                    f"({redact(str(exc)).splitlines()[0][:160]}); training goes on and records "
                    "are kept until it returns",
                    file=sys.stderr,
                )
            return False
        if self._away_since is not None:
            gap = time.monotonic() - self._away_since
            self._away_since = None
            print(
                f"rayacc: tracking server back after {gap:.0f} s; the records kept meanwhile "
                f"are being written ({self._queue.qsize() + 1} call(s) waiting)",
                file=sys.stderr,
            )
        return True

    def drain(self, timeout_s: float = 60.0) -> int:
        """Waits up to `timeout_s` for the queued writes; the number of records not written."""
        if self._writer is None:
            return 0
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._queue.mutex:
            queued = sum(item[2] for item in self._queue.queue if item is not None)
        return queued + self._in_flight

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in param_items(params)]
        for i in range(0, len(items), _MAX_PARAMS_PER_CALL):
            chunk = items[i : i + _MAX_PARAMS_PER_CALL]
            self._call("log_batch", (), chunk, records=len(chunk))

    def log_step_metrics(self, records: Iterable[dict[str, Any]]) -> None:
        """Records carry `step` and numeric metrics. A (key, step) already logged is dropped, so a
        worker group restarted from a checkpoint never records a step twice."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = []
        for rec in records:
            step = int(rec["step"])
            # when the step ended on the rank (records reach the driver in bursts)
            at = int(rec[TIME_KEY] * 1000) if isinstance(rec.get(TIME_KEY), float) else now
            for key, value in rec.items():
                if key in ("step", TIME_KEY) or not isinstance(value, (int, float)):
                    continue
                if isinstance(value, bool):
                    continue
                if (key, step) in self._logged_steps or not math.isfinite(float(value)):
                    continue
                self._logged_steps.add((key, step))
                metrics.append(Metric(key, float(value), at, step))
        for i in range(0, len(metrics), _MAX_METRICS_PER_CALL):
            chunk = metrics[i : i + _MAX_METRICS_PER_CALL]
            self._call("log_batch", chunk, records=len(chunk))

    def log_model_of(
        self,
        name: str,
        step: int,
        checkpoint: str,
        model_type: str,
        weights: Callable[[], Any] | None = None,
    ) -> None:
        """The run's final model as an MLflow logged model of the run, output at `step`, that
        MLflow's loaders load (`mlflow.pytorch.load_model`): `weights()` (the checkpoint's
        model, `load_model`) saved in MLflow's PyTorch format, and `rayacc.checkpoint` naming
        the checkpoint (`rayacc sample`, `export` and `load_model` read it). Where its weights
        cannot be read or saved here, no logged model: one line says why."""
        if not self.active:
            return
        try:
            folder = _pytorch_model(weights) if weights is not None else None
        except Exception as exc:
            print(f"rayacc: no MLflow logged model {redact(name)}: its weights could not be "
                  f"saved for MLflow ({type(exc).__name__}: {redact(str(exc))[:300]}); the "
                  f"checkpoint holds them", file=sys.stderr)  # fmt: skip
            return
        self._call("_model", name, step, checkpoint, model_type, folder)

    def _model_now(
        self, name: str, step: int, checkpoint: str, model_type: str, folder: str | None
    ) -> None:
        from mlflow.entities import LoggedModelOutput

        shown, tags = (
            redact(name),
            {"rayacc.checkpoint": redact(checkpoint), "rayacc.step": str(step)},
        )
        # a retry after the server made it (and went away before the rest) finishes that one
        made = [
            m
            for m in self.client.search_logged_models(
                [self.experiment_id], filter_string=f"source_run_id = '{self.run_id}'"
            )
            if m.name == shown and all(m.tags.get(k) == v for k, v in tags.items())
        ]
        model = (
            made[0]
            if made
            else self.client.create_logged_model(
                self.experiment_id,
                name=shown,
                source_run_id=self.run_id,
                tags=tags,
                model_type=model_type,
            )
        )
        if folder is not None:
            self.client.log_model_artifacts(model.model_id, folder)
        self.client.finalize_logged_model(model.model_id, "READY")
        if folder is not None:
            shutil.rmtree(Path(folder).parent, ignore_errors=True)
        outputs = self.client.get_run(self.run_id).outputs
        if not any(
            o.model_id == model.model_id for o in (outputs.model_outputs if outputs else [])
        ):
            self.client.log_outputs(self.run_id, [LoggedModelOutput(model.model_id, step)])

    def log_dataset(
        self, name: str, digest: str, source: str, profile: dict[str, Any], context: str
    ) -> None:
        """The run's data as an MLflow dataset input (`log_input`'s record: name, digest, where
        it is read from, its size), in `context` (`training`, `validation`)."""
        import json

        from mlflow.entities import Dataset, DatasetInput, InputTag

        scheme = source.split("://", 1)[0] if "://" in source else "local"
        dataset = Dataset(
            name=redact(name),
            digest=digest[:36],
            source_type=scheme,
            source=json.dumps({"uri": redact(source)}),
            profile=json.dumps(profile),
        )
        self._call(
            "log_inputs", [DatasetInput(dataset, [InputTag("mlflow.data.context", context)])]
        )

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        tags = [RunTag(k, redact(str(v))) for k, v in tags.items()]
        self._call("log_batch", (), (), tags, records=len(tags))

    def log_artifact(self, path: str | Path) -> None:
        """A file rayacc wrote: a text file's words masked on the way (`log_text` of its masked
        text under its name), an image as it is (its labels were masked when drawn)."""
        path = Path(path)
        if path.suffix in TEXT_SUFFIXES:
            self.log_text(path.read_text(errors="replace"), path.name)
        else:
            self._call("log_artifact", str(path))

    def log_text(self, text: str, name: str) -> None:
        self._call("log_text", redact(text), name)

    def forget_after(self, step: int) -> int | None:
        """The last optimizer step after `step` the run holds (or has queued) a metric at, or
        None; those (key, step) pairs are forgotten, so the steps done again are logged anew
        (the caller marks the points held: `tracking/history.py`)."""
        after = {(k, s) for k, s in self._logged_steps if s > step}
        self._logged_steps -= after
        return max((s for _, s in after), default=None)

    def finish(self, status: str = "FINISHED", timeout_s: float = 60.0) -> None:
        """Marks the run ended and waits (at most `timeout_s`) for every queued write."""
        self._call("set_terminated", status)
        if self._writer is None:
            return
        left = self.drain(timeout_s)
        self._queue.put(None)  # the writer ends after what is queued
        if left:
            print(
                f"rayacc: {left} tracking record(s) could not be written: the server at "
                f"{redact(self.tracking_uri)} did not come back within {timeout_s:.0f} s",
                file=sys.stderr,
            )


TEXT_SUFFIXES = (".txt", ".csv", ".yaml", ".yml", ".json", ".md", ".log")
"""Files whose words are masked before they are stored (every other kind rayacc writes is an
image)."""


def tag_run(tracking_uri: str, run_id: str, key: str, value: str) -> None:
    """Sets one tag of a run that has ended (`rayacc verify`'s verdict), masked as every tag."""
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri).set_tag(run_id, redact(key), redact(str(value)))


def log_files(tracking_uri: str, run_id: str, files: Iterable[Path], folder: str) -> None:
    """Stores files rayacc wrote under `folder` of a run (a sweep's report): text masked as
    `MlflowSink.log_artifact` masks it."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    for f in map(Path, files):
        if f.suffix in TEXT_SUFFIXES:
            client.log_text(run_id, redact(f.read_text(errors="replace")), f"{folder}/{f.name}")
        else:
            client.log_artifact(run_id, str(f), folder)


def param_items(params: dict[str, Any]) -> list[tuple[str, str]]:
    """MLflow's (key, value) of each param, masked: by value, and whole where the key's last
    part names a secret (`model.kwargs.hub_token`)."""
    return [(k, _param_str(v)) for k, v in redact(dict(params)).items()]


def _param_str(value: Any) -> str:
    text = "null" if value is None else str(value)
    # MLflow caps a param value at 6000 characters
    return text if len(text) <= 6000 else text[:5997] + "..."


def _pytorch_model(weights: Callable[[], Any]) -> str:
    """A folder holding `weights()` as MLflow's PyTorch flavor saves it (pickled: `pt2` needs
    an input to trace; its requirements named: inferring them loads the model again)."""
    import logging
    import tempfile
    from importlib.metadata import version

    import mlflow.pytorch
    import torch

    module = weights()
    folder = Path(tempfile.mkdtemp(prefix="rayacc-mlflow-model-")) / "model"
    quiet = logging.getLogger("mlflow.pytorch")  # its warning about pickles, said in the docs
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        mlflow.pytorch.save_model(
            module,
            str(folder),
            serialization_format="pickle",
            pip_requirements=[f"torch=={torch.__version__}", f"rayacc=={version('rayacc')}"],
        )
        umask_modes(folder)  # a file store copies the modes: others read the model as theirs
    except BaseException:
        shutil.rmtree(folder.parent, ignore_errors=True)
        raise
    finally:
        quiet.setLevel(level)
    return str(folder)
