"""What a user reads on the console while a run trains: the run's header, one progress line per
tenth of the run (and per validation), the summary, and the console's one rule for Ray's own
log records (shown with RAYACC_VERBOSE=1 only).

`ProgressPrinter` is a RunObserver: the CLI uses it, and a library caller passes it to
`fit(cfg, observers=[ProgressPrinter()])` (fit alone prints nothing).

Every console rayacc prints on is `make_console()`'s: text is printed as given, never parsed as
markup (a path may hold `[ml]` or `[/a]`, an error `[rank1]:`) and never highlighted (a
highlighter's colour codes would split a URI before the stream boundary masks it); styles come
only from `styled` parts.
"""

from __future__ import annotations

import re
import statistics
import time
from collections import deque
from typing import Any

from rayacc.config.batch_split import BatchSplit
from rayacc.engine.parallel import strategy_class
from rayacc.observe import goodput
from rayacc.observe.events import Event, RunObserver, RunStarted
from rayacc.observe.ranks import TIME_KEY
from rayacc.redact import OWN, RedactingStream

__all__ = [
    "Eta",
    "ProgressPrinter",
    "QuietRayStream",
    "clock",
    "make_console",
    "perf_summary",
    "progress_line",
    "run_header",
    "strategy_line",
    "styled",
    "summary_lines",
    "val_parts",
]


def make_console(*, stderr: bool = False, width: int | None = None, **options):
    """A rich console that prints text as given: no markup, no highlighting; paths and URIs
    stay on one line, copyable (soft wrap). `options`: rich's others (file, force_terminal)."""
    from rich.console import Console

    return Console(
        stderr=stderr, soft_wrap=True, markup=False, highlight=False, width=width, **options
    )


def styled(*parts):
    """One line of plain text parts and (text, style) parts; no part is parsed as markup."""
    from rich.text import Text

    return Text.assemble(*parts)


VAL_NAMES = {"val/loss": "val_loss", "val/accuracy": "val_acc"}
"""Validation metrics as the console names them (MLflow keeps the `val/…` keys)."""


UI_PORT = 5000
"""The port the printed `mlflow ui` command names, and its link opens."""
UI_VIEW = "workflowType=machine_learning"
"""The query that opens an MLflow 3 UI page in its model-training view (not the GenAI one)."""
SAVED_VIEW = "rayacc-loss-first"
"""The saved view of every experiment rayacc records in (`tracking/ui_view.py`)."""


def charts_link(experiment_id: str) -> str:
    """The UI's page (after its address) with the experiment's runs charted in its saved view,
    the loss first (a run's own page orders its sections by name). The UI opens a saved view
    only from a link without search settings: it cannot also pick the run."""
    OWN.add(SAVED_VIEW)
    view = f"viewStateShareKey={SAVED_VIEW}&{UI_VIEW}&compareRunsMode=CHART"
    return f"#/experiments/{experiment_id}/runs?{view}"


def clock(seconds: float | None) -> str:
    """`m:ss` or `h:mm:ss`; `?` when unknown."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    s = round(seconds)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Eta:
    """Seconds left, from the rate at which steps ended (on rank 0, as their records say) over
    the recent past: the last 30 s or the last quarter of the steps since the group started,
    whichever is longer; validation and checkpoint pauses inside that span count. A
    (re)started group starts a new span at its first step: none is said before two steps."""

    def __init__(self, window_s: float = 30.0):
        self.window_s = window_s
        self.points: deque[tuple[float, int]] = deque()
        self.start_step = 0

    def restart(self, step: int) -> None:
        """A (re)started group at `step`: the rate counts from its first step's end on (its
        set-up is no step's time)."""
        self.points.clear()
        self.start_step = step

    def observe(self, step: int, t: float) -> None:
        self.points.append((t, step))
        min_steps = (step - self.start_step) // 4
        # the oldest point goes only while the span after it is still long enough
        while len(self.points) > 2:
            t1, s1 = self.points[1]
            if t - t1 < self.window_s or step - s1 < min_steps:
                break
            self.points.popleft()

    def seconds_left(self, total: int) -> float | None:
        if len(self.points) < 2:
            return None
        (t0, s0), (t1, s1) = self.points[0], self.points[-1]
        if s1 <= s0 or t1 <= t0:
            return None
        return max(0, total - s1) * (t1 - t0) / (s1 - s0)


def progress_line(record: dict[str, Any], total: int, elapsed_s: float, eta_s: float | None) -> str:
    """`step 30/60  0:12 elapsed  ETA 0:10  loss 0.1339  lr 8.1e-04  25,265 samples/s
    [12,000 tokens/s]  [MFU 41.2%]  [val_loss 0.2629  val_acc 95.10%]`."""
    parts = [
        f"step {record['step']}/{total}",
        f"{clock(elapsed_s)} elapsed",
        *([f"ETA {clock(eta_s)}"] if eta_s is not None else []),
        f"loss {record['train/loss']:.4f}",
        f"lr {record['train/lr']:.3g}",
        f"{record['train/samples_per_s']:,.0f} samples/s",
    ]
    if "perf/tokens_per_s" in record:
        parts.append(f"{record['perf/tokens_per_s']:,.0f} tokens/s")
    if "perf/mfu" in record:
        parts.append(f"MFU {record['perf/mfu']:.1%}")
    return "  ".join(parts + val_parts(record))


def val_parts(record: dict[str, Any]) -> list[str]:
    """The record's validation metrics as the console names them: `val_loss 0.2629`,
    `val_acc 95.10%` (progress lines, the summary, a sweep's trial lines)."""
    return [
        f"{name} {record[key]:.2%}" if key == "val/accuracy" else f"{name} {record[key]:.4f}"
        for key, name in VAL_NAMES.items()
        if key in record
    ]


class ProgressPrinter(RunObserver):
    """Progress of a run on a rich console: a line every tenth of the run and at every
    validation (or, with `bar=True` on a terminal, a live bar with the same fields), and the
    run's events as lines of their own. Use it as a context manager for the bar."""

    def __init__(
        self, console=None, total_steps: int | None = None, bar: bool = False, elastic=False
    ):
        if console is None:
            console = make_console()
        self.console = console
        self.elastic = elastic
        """An elastic run: each group says its size as it starts (the header gives the
        range)."""
        self.total = total_steps
        self.bar = bar and console.is_terminal
        self.started = time.time()
        self.eta = Eta()
        self.progress = None
        self.task = None
        self.group: RunStarted | None = None
        """The fit's latest worker group."""
        self.recoveries = goodput.Recoveries()

    def __enter__(self):
        if self.bar:
            from rich.progress import BarColumn, Progress, TextColumn

            self.progress = Progress(
                BarColumn(), TextColumn("{task.fields[info]}", markup=False), console=self.console
            )
            self.progress.__enter__()
            self.task = self.progress.add_task("train", total=self.total, info="starting workers")
        return self

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.__exit__(*exc)

    def on_event(self, event: Event) -> None:
        self.recoveries.on_event(event)
        if isinstance(event, RunStarted) or getattr(event, "total_steps", None):
            self.total = event.total_steps  # a run's start, or auto's new batch
        if isinstance(event, RunStarted):
            self.eta.restart(event.step)
            line = event.describe(self.group)
            if self.elastic and self.group is None:
                size = f"a group of {event.split['num_workers']} workers starts: " + (
                    BatchSplit(**event.split).describe())  # fmt: skip
                line = "\n  ".join(filter(None, [size, line]))
            self.group = event
        else:
            line = event.console_line()
        if line:
            self.console.print(f"  {line}")

    def on_step(self, record: dict[str, Any]) -> None:
        recovery = self.recoveries.on_step(record)
        if recovery is not None:
            self.console.print(f"  {recovery.console_line()}")
        # the step's own time on the rank: records reach the driver in bursts
        at = record.get(TIME_KEY)
        now = at if isinstance(at, float) else time.time()
        step = record["step"]
        total = self.total or step
        self.eta.observe(step, now)
        line = progress_line(record, total, now - self.started, self.eta.seconds_left(total))
        validated = any(k in record for k in VAL_NAMES)
        if self.progress is not None:
            self.progress.update(self.task, total=total, completed=step, info=line)
            if validated:
                self.console.print(f"  {line}")
        elif validated or step % max(1, total // 10) == 0 or step == total:
            self.console.print(f"  {line}")


# ----------------------------------------------------------------------------- header, summary
def strategy_line(cfg) -> str:
    """How the run computes: strategy, precision, activation checkpointing, data order."""
    t = cfg.train
    strategy = strategy_class(t.strategy).describe(cfg)
    ac = t.activation_checkpointing
    recompute = ac if isinstance(ac, str) else f"every {ac.every_n} blocks"
    order = f"shuffled each epoch (seed {cfg.seed})" if cfg.data.shuffle else "stored order"
    compiled = ", torch.compile" if t.compile else ""
    return (
        f"strategy {strategy}; precision {t.precision}{compiled}; activation checkpointing "
        f"{recompute}; data {order}"
    )


def length_note(cfg, steps_per_epoch: int) -> str:
    """What set the run's length, where train.max_steps did without an epoch count."""
    if cfg.train.epochs is not None or not cfg.train.max_steps or not steps_per_epoch:
        return ""
    epochs = cfg.train.max_steps / steps_per_epoch
    return f" (train.max_steps; {epochs:.3g} epoch{'s' if epochs != 1 else ''} of data)"


def _adapters(cfg, prep) -> str:
    """The adapters a LoRA run trains, and how many of the parameters they are."""
    lora = cfg.model.lora
    if lora is None:
        return ""
    share = prep.trainable_parameters / max(1, prep.num_parameters)
    from rayacc.models.lora import GPT_TARGETS

    default = GPT_TARGETS if cfg.model.name == "gpt" else ["peft's layers for the architecture"]
    layers = ", ".join(lora.target_modules or default)
    return (
        f" (LoRA r={lora.r} on {layers}: {prep.trainable_parameters:,} trainable, "
        f"{share:.2%}; the base frozen)"
    )


def run_header(cfg, prep, data_path: str) -> list[str]:
    """The lines a run starts with: the batch arithmetic, the LR, how it computes, the data and
    the model (`prep`: the driver's Prepared)."""
    from rayacc.run.quantities import lr_explanation, phases_summary

    s = cfg.scaling
    first = prep.split.describe()
    if s.elastic:  # the group's size is said as it starts: the range here
        first = (f"global batch {prep.split.global_batch_size} over {s.min_workers}–"
                 f"{s.max_workers} workers (elastic: each size's split below)")  # fmt: skip
    return [
        first,
        lr_explanation(cfg, prep.split),
        *phases_summary(cfg, prep.spec.phases),
        strategy_line(cfg),
        f"data: {data_path} — {prep.layout.describe()}",
        f"model: {cfg.model.name}, {prep.num_parameters:,} parameters{_adapters(cfg, prep)}; "
        f"{prep.total_steps} optimizer steps{length_note(cfg, prep.layout.steps_per_epoch)}",
        *prep.notes,
    ]


STEADY_AFTER = 3
"""Steps left out of the per-step medians (start-up: compilation, caches, allocator)."""


def perf_summary(history: list[dict]) -> str:
    """Medians of the steady-state steps' cost metrics, as one line that says which steps."""
    steady = history[STEADY_AFTER:]
    which = f"median of steps {STEADY_AFTER + 1}–{len(history)}"
    if not steady:
        steady = history
        which = f"median of all {len(history)} step{'s' if len(history) != 1 else ''}"
    parts = []
    for key, label, fmt in (
        ("train/samples_per_s", "samples/s", "{:,.0f}"),
        ("perf/tokens_per_s", "tokens/s", "{:,.0f}"),
        ("perf/tflops", "TFLOP/s per worker", "{:.3g}"),
        ("perf/mfu", "MFU", "{:.1%}"),
        ("perf/hfu", "HFU (with the recompute)", "{:.1%}"),
        ("perf/data_wait_frac", "data wait", "{:.1%}"),
        ("comm/sync_time_frac", "gradient sync", "{:.1%}"),
        ("mem/peak_mb", "peak memory MB", "{:,.0f}"),
    ):
        values = [r[key] for r in steady if isinstance(r.get(key), (int, float))]
        if values:
            parts.append(f"{label} {fmt.format(statistics.median(values))}")
    return f"per step ({which}): " + ", ".join(parts) if parts else ""


def summary_lines(cfg, result) -> list[str]:
    """What the console says of a finished fit (the first line is the heading)."""
    from rayacc.redact import redact
    from rayacc.run.quantities import lr_explanation

    split = result.split
    m = result.metrics
    lines: list[Any] = [styled(("done", "bold")), split.describe(), lr_explanation(cfg, split)]
    if m:
        line = f"step {m.get('step')}: train loss {m.get('train/loss', float('nan')):.4f}"
        lines.append("".join([line, *(f", {part}" for part in val_parts(m))]))
        if m.get("train/skipped_steps"):
            lines.append(
                styled(
                    (f"{m['train/skipped_steps']} step(s) skipped", "yellow"),
                    " for a non-finite loss or gradient (train/skipped_steps)",
                )
            )
    resumed = result.summary.get("resumed_from")
    if resumed is not None and result.history:
        lines.append(
            f"resumed from the checkpoint at step {resumed}; the history (MLflow, loss curve) "
            f"holds steps {result.history[0]['step']}–{result.history[-1]['step']} of the run"
        )
    perf = perf_summary(result.history)
    if perf:
        lines.append(perf)
    if result.goodput:
        lines.append(goodput.describe(result.goodput))
    else:
        lines.append(
            f"wall time {result.wall_time_s:.1f} s "
            f"(training steps {result.summary.get('train_time_s', 0.0):.1f} s)"
        )
    for own in (result.mlflow_run_id, result.mlflow_experiment_id, result.checkpoint_dir):
        OWN.add(own)  # identifiers rayacc made: no pattern takes them for a secret
    if result.mlflow_run_id:
        uri = redact(result.tracking_uri)
        lines.append(f"MLflow run {result.mlflow_run_id} in {uri}")
        # the run's page in MLflow's model-training view: MLflow 3's UI goes by the link's
        # workflowType (or the browser's last choice), not by the experiment's kind tag
        page = f"#/experiments/{result.mlflow_experiment_id}/runs/{result.mlflow_run_id}?{UI_VIEW}"
        charts = charts_link(result.mlflow_experiment_id)
        if uri and uri.startswith(("http://", "https://")):
            address = uri.rstrip("/")
            lines.append(f"  open the UI: {address}/{page}")
        else:
            # the port said in the command the link is for (MLflow's default, 5000, is taken
            # on many machines: change both)
            address = f"http://127.0.0.1:{UI_PORT}"
            lines.append(
                f"  open the UI: mlflow ui --backend-store-uri {uri} --port {UI_PORT}, then "
                f"{address}/{page}"
            )
        lines.append(f"  the experiment's runs charted, loss first: {address}/{charts}")
    lines.append(f"checkpoint: {result.checkpoint_dir}")
    if result.checkpoint_dir and result.summary.get("token_model"):
        lines.append(f"  sample it: rayacc sample {result.checkpoint_dir}")
    return lines


# ----------------------------------------------------------------------------- Ray's records
_RAY_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}\t(DEBUG|INFO|WARNING) \S+:\d+ -- ")
"""A record as Ray's console handlers (Ray Core's, Ray Data's) format it, below ERROR."""


class QuietRayStream(RedactingStream):
    """The console's stream (redacting, as RedactingStream) that also drops Ray's own log
    records below ERROR (a logging handler writes a record in one call): the console carries
    rayacc's lines and errors; Ray keeps its records in its session's log files. The CLI
    installs it unless RAYACC_VERBOSE=1."""

    def write(self, text: str) -> int:
        # a record, continuation lines and all, is one write that begins a line
        if not self._partial and _RAY_RECORD.match(text):
            return len(text)
        return super().write(text)
