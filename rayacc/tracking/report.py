"""The comparison of a sweep's trials, from MLflow: the answer to its question (which setting
is fastest for the same result), a table (printed, CSV) and three plots."""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rayacc.redact import redact
from rayacc.tracking.history import lineage_points
from rayacc.tracking.lookup import ReportError, resolve_parent
from rayacc.tracking.plots import legend_beside

__all__ = ["Report", "ReportError", "TrialRow", "build_report", "write_report"]

COLUMNS = [
    ("trial", "trial"),
    ("workers", "workers"),
    ("micro", "micro"),
    ("accum", "accum"),
    ("global_batch", "global batch"),
    ("effective_lr", "effective LR"),
    ("final_train_loss", "final train loss"),
    ("best_val", "best val"),
    ("samples_per_s", "samples/s"),
    ("peak_mem_mb", "peak MB"),
    ("sync_frac", "sync share"),
    ("time_to_target_s", "train s to common loss"),
    ("wall_time_s", "wall s"),
]
SMOOTH_STEPS = 5
"""Train losses are compared as trailing means over this many steps (one step is noisy)."""
SAME_LOSS_RTOL = 1e-3
"""Final losses within this relative spread are the same result (rounding, not learning)."""


@dataclass
class TrialRow:
    trial: str
    run_id: str
    status: str
    workers: int
    micro: int
    accum: int
    global_batch: int
    effective_lr: float
    final_train_loss: float
    best_val: float
    best_val_metric: str
    samples_per_s: float
    peak_mem_mb: float
    sync_frac: float
    wall_time_s: float
    """The fit's wall time (the same measure the sweep's console prints)."""
    predicted_step_s: float = math.nan
    """A trial from a plan: the planner's predicted step time."""
    predicted_memory_mb: float = math.nan
    """A trial from a plan: the planner's predicted memory per rank."""
    step_s: float = math.nan
    """The median step time of the run (steps after the first)."""
    stopped_early: str = ""
    """When and why the sweep's scheduler stopped the trial (`rayacc.stopped_early`)."""
    time_to_target_s: float = math.nan
    """Training-step seconds (validation, checkpoints and start-up left out) to the report's
    common loss: the whole run's when the trials agree on the final loss, else until the
    trial's smoothed train loss first reached it."""


@dataclass
class Report:
    parent_run_id: str
    rows: list[TrialRow]
    loss_curves: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    """Trial label → (samples seen, train loss) per optimizer step."""
    files: list[Path] = field(default_factory=list)
    target_loss: float = math.nan
    """The common result: the final train loss when the trials agree on it, else the lowest
    smoothed train loss that every finished trial reached."""

    def verdict(self) -> list[str]:
        """The answer to a sweep's question, which setting is fastest for the same result:
        whether the trials reached the same loss, and the trials ranked by time to the common
        loss, by throughput and by peak memory."""
        done = [
            r for r in self.rows if r.status == "FINISHED" and math.isfinite(r.final_train_loss)
        ]
        stopped = [
            f"trial {r.trial} stopped early {r.stopped_early}" for r in self.rows if r.stopped_early
        ]
        if not done:
            return stopped
        if len(done) == 1:  # nothing to compare it with
            (only,) = done
            finished = f"trial {only.trial} ({_setting(only)})"
            loss = only.final_train_loss
            return [f"one trial finished: {finished}, final loss {loss:.4f}", *stopped]
        losses = [r.final_train_loss for r in done]
        batches = {r.global_batch for r in done}
        spread = (max(losses) - min(losses)) / max(abs(min(losses)), 1e-12)
        # the same math is promised where only the split differs: one global batch, one LR
        one_batch = len(batches) == 1 and len({r.effective_lr for r in done}) == 1
        if spread <= SAME_LOSS_RTOL:
            why = ", as expected at one global batch" if one_batch else ""
            result = (
                f"same final loss {statistics.median(losses):.4f} in all {len(done)} trials{why}"
            )
        else:
            why = (
                " (at one global batch they should agree: see docs/design.md, 'Same math')"
                if one_batch
                else ""
            )
            result = (
                f"final losses differ, {min(losses):.4f}–{max(losses):.4f}{why}; compared at "
                f"the loss all reached, {self.target_loss:.4f}"
            )
        timed = [r for r in done if math.isfinite(r.time_to_target_s)]
        lines = [result]
        if timed:
            fast = min(timed, key=lambda r: r.time_to_target_s)
            slow = max(timed, key=lambda r: r.time_to_target_s)
            ratio = slow.time_to_target_s / fast.time_to_target_s if fast.time_to_target_s else 1
            lines[0] += (
                f"; fastest: trial {fast.trial} ({_setting(fast)}), "
                f"{fast.time_to_target_s:.2f} s of training steps to loss "
                f"{self.target_loss:.4f} (wall {fast.wall_time_s:.1f} s with start-up), "
                f"{ratio:.2f}× faster than trial {slow.trial}"
            )
            lines.append(
                "by training time to the common loss (fastest first): "
                + _ranking(timed, "time_to_target_s")
            )
        lines += self.plan_lines()
        for attr, label, high in (
            ("samples_per_s", "by throughput (samples/s, highest first)", True),
            ("peak_mem_mb", "by peak memory (MB, least first)", False),
        ):
            ok = [r for r in done if math.isfinite(getattr(r, attr))]
            if ok:
                lines.append(f"{label}: " + _ranking(ok, attr, reverse=high))
        return lines + stopped

    def plan_lines(self) -> list[str]:
        """Trials from a plan: the planner's predicted step time and memory beside the run's
        (the run's peak memory is the allocator's on a GPU, the process's resident set on a
        CPU, where the planner counts only what the step holds: compare them on GPU runs)."""
        rows = [r for r in self.rows if math.isfinite(r.predicted_step_s)]
        if not rows:
            return []
        parts, errors = [], []
        for r in rows:
            err = r.predicted_step_s / r.step_s - 1 if math.isfinite(r.step_s) else math.nan
            if math.isfinite(err):
                errors.append(abs(err))
            parts.append(
                f"trial {r.trial} ({_setting(r)}): step {r.predicted_step_s:.4g} s predicted, "
                f"{r.step_s:.4g} s measured ({100 * err:+.0f}%); memory "
                f"{r.predicted_memory_mb:,.1f} MiB predicted, peak {r.peak_mem_mb:,.0f} MB"
            )
        head = "the plan's prior vs the trials"
        if errors:
            head += f" (median |step-time error| {100 * statistics.median(errors):.0f}%)"
        return [f"{head}: " + "; ".join(parts)]

    def per_micro(self, attr: str) -> dict[str, tuple[list[float], list[float]]]:
        """Worker count label → (micro-batch sizes, `attr` of each trial)."""
        series: dict[str, tuple[list[float], list[float]]] = {}
        for row in self.rows:
            xs, ys = series.setdefault(f"{row.workers} worker(s)", ([], []))
            xs.append(row.micro)
            ys.append(getattr(row, attr))
        return series


def _setting(r: TrialRow) -> str:
    return f"micro {r.micro} × accum {r.accum} × {r.workers} worker(s)"


def _ranking(rows: list[TrialRow], attr: str, reverse: bool = False) -> str:
    ranked = sorted(rows, key=lambda r: getattr(r, attr), reverse=reverse)
    fmt = "{:,.0f}" if attr != "time_to_target_s" else "{:.2f} s"
    return ", ".join(f"trial {r.trial} {fmt.format(getattr(r, attr))}" for r in ranked)


def smoothed(values: list[float], n: int = SMOOTH_STEPS) -> list[float]:
    """Trailing means over up to `n` values."""
    out, window = [], []
    for v in values:
        window = [*window[-(n - 1) :], v] if n > 1 else [v]
        out.append(sum(window) / len(window))
    return out


def time_to_loss(
    losses: list[tuple[int, float]], step_times: dict[int, float], target: float
) -> float:
    """Training-step seconds until the smoothed loss first reached `target` (nan: never)."""
    elapsed = 0.0
    for (step, _), value in zip(losses, smoothed([v for _, v in losses]), strict=True):
        elapsed += step_times.get(step, 0.0)
        if value <= target * (1 + 1e-9):
            return elapsed
    return math.nan


def _history(client, run, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in lineage_points(client, run, key)]


def build_report(tracking_uri: str, target: str) -> Report:
    """Collects every child run of the sweep `target` (a parent run id, or an experiment: its
    latest sweep)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    parent_id = resolve_parent(client, target)
    parent = client.get_run(parent_id)
    children = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
        order_by=["attributes.start_time ASC"],
    )
    if not children:
        raise ReportError(f"run {parent_id} has no child runs: is it a sweep's parent run?")
    report = Report(parent_id, [])
    curves: dict[str, tuple[list[tuple[int, float]], dict[int, float]]] = {}
    for run in sorted(children, key=lambda r: int(r.data.tags.get("rayacc.trial", 0))):
        p, rid = run.data.params, run.info.run_id
        loss = _history(client, run, "train/loss")
        samples = _history(client, run, "train/samples")
        sps = [v for s, v in _history(client, run, "train/samples_per_s") if s > 1]
        val_key = "val/accuracy" if _history(client, run, "val/accuracy") else "val/loss"
        val = [v for _, v in _history(client, run, val_key)]
        best = (max(val) if val_key == "val/accuracy" else min(val)) if val else math.nan
        mem = [v for _, v in _history(client, run, "mem/peak_mb")]
        sync = [v for _, v in _history(client, run, "comm/sync_time_frac")]
        end = run.info.end_time or run.info.start_time
        # the fit's own measure (the console's); a run that predates the tag: MLflow's times
        wall = run.data.tags.get("rayacc.wall_time_s")
        label = f"trial {run.data.tags.get('rayacc.trial', '?')}"
        row = TrialRow(
            trial=label.removeprefix("trial "),
            run_id=rid,
            status=run.info.status,
            workers=int(p.get("num_workers", 0)),
            micro=int(p.get("micro_batch_size", 0)),
            accum=int(p.get("grad_accum_steps", 0)),
            global_batch=int(p.get("global_batch_size", 0)),
            effective_lr=float(p.get("effective_lr", "nan")),
            final_train_loss=loss[-1][1] if loss else math.nan,
            best_val=best,
            best_val_metric=val_key,
            samples_per_s=statistics.median(sps) if sps else math.nan,
            peak_mem_mb=max(mem) if mem else math.nan,
            sync_frac=statistics.mean(sync) if sync else math.nan,
            wall_time_s=float(wall) if wall else (end - run.info.start_time) / 1000,
            predicted_step_s=float(run.data.tags.get("rayacc.predicted_step_s", "nan")),
            predicted_memory_mb=float(run.data.tags.get("rayacc.predicted_memory_mb", "nan")),
            stopped_early=run.data.tags.get("rayacc.stopped_early", ""),
        )
        report.rows.append(row)
        curves[rid] = loss, dict(_history(client, run, "perf/step_time_s"))
        steps = [v for s, v in curves[rid][1].items() if s > 1]
        row.step_s = statistics.median(steps) if steps else math.nan
        seen, total = [], 0.0
        per_step = dict(samples)
        for step, _ in loss:
            total += per_step.get(step, 0.0)
            seen.append(total)
        report.loss_curves[f"{label}: {row.micro}×{row.accum}×{row.workers}"] = (
            seen,
            [v for _, v in loss],
        )
    reached = [
        min(smoothed([v for _, v in curves[r.run_id][0]]))
        for r in report.rows
        if r.status == "FINISHED" and curves[r.run_id][0]
    ]
    if reached:
        finals = [r.final_train_loss for r in report.rows if r.status == "FINISHED"]
        same = (max(finals) - min(finals)) <= SAME_LOSS_RTOL * max(abs(min(finals)), 1e-12)
        # one result (one global batch): the time to it is the whole run's training time
        report.target_loss = max(finals) if same else max(reached)
        for r in report.rows:
            if r.status != "FINISHED":
                continue
            losses, step_times = curves[r.run_id]
            r.time_to_target_s = (
                sum(step_times.values())
                if same
                else time_to_loss(losses, step_times, report.target_loss)
            )
    return report


LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def _plot_xy(
    path: Path, title: str, xlabel: str, ylabel: str, series, scatter: bool, note: str = ""
) -> tuple[float, float]:
    """Curves that coincide (trials at one global batch) stay visible: each series has its
    own line style, marker and width, the later ones drawn thinner on top. Scatter plots of a
    quantity (throughput, memory) start their axis at 0, so a 1 MB difference looks like one.
    Returns the y axis's range as drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    every = max(1, max((len(x) for x, _ in series.values()), default=1) // 8)
    # a trial's label, a title or a note may quote a setting: the picture is a file rayacc writes
    title, note = redact(title), redact(note)
    series = {redact(label): xy for label, xy in series.items()}
    for i, (label, (x, y)) in enumerate(series.items()):
        marker = MARKERS[i % len(MARKERS)]
        if scatter:
            ax.plot(x, y, marker, label=label, markersize=7, alpha=0.8)
        else:
            ax.plot(
                x,
                y,
                LINE_STYLES[i % len(LINE_STYLES)],
                marker=marker,
                # staggered, so that the markers of coinciding curves do not cover one another
                markevery=(i * every // len(series), every),
                linewidth=max(0.8, 3.0 - 0.6 * i),
                label=label,
                alpha=0.85,
            )
    if scatter:
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.1)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    legend_beside(ax)
    if note:
        ax.text(0.01, 0.01, note, transform=ax.transAxes, fontsize=7, va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return ax.get_ylim()


def coincide_note(curves: dict[str, tuple[list[float], list[float]]]) -> str:
    """A note for loss curves that lie on one another (the largest gap between any two at the
    same step is under 1 % of the loss), else ''."""
    ys = [y for _, y in curves.values() if y]
    if len(ys) < 2 or len({len(y) for y in ys}) != 1:
        return ""
    gap = max(max(col) - min(col) for col in zip(*ys, strict=True))
    scale = max(abs(v) for y in ys for v in y) or 1.0
    if gap > 0.01 * scale:
        return ""
    return f"the {len(ys)} curves coincide (largest gap {gap:.2g}): the same samples and loss"


def write_report(
    report: Report, out_dir: str | Path, tracking_uri: str | None = None
) -> list[Path]:
    """Writes report.csv and three PNGs to `out_dir`; logs them on the parent run when
    `tracking_uri` is given."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "report.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(report.rows[0])))
        writer.writeheader()
        for row in report.rows:
            writer.writerow(redact(asdict(row)))
    files = [
        csv_path,
        out / "loss_vs_samples.png",
        out / "throughput_vs_micro.png",
        out / "memory_vs_micro.png",
    ]
    _plot_xy(
        files[1],
        "train loss against samples seen",
        "samples seen",
        "train loss",
        report.loss_curves,
        scatter=False,
        note=coincide_note(report.loss_curves),
    )
    _plot_xy(
        files[2],
        "throughput against micro-batch size",
        "micro-batch size",
        "samples/s (median)",
        report.per_micro("samples_per_s"),
        scatter=True,
    )
    _plot_xy(
        files[3],
        "peak memory against micro-batch size",
        "micro-batch size",
        "peak MB (max over steps)",
        report.per_micro("peak_mem_mb"),
        scatter=True,
    )
    report.files = files
    if tracking_uri:
        from rayacc.tracking.mlflow_sink import log_files

        log_files(tracking_uri, report.parent_run_id, files, "report")
    return files


def _trial_state(r: TrialRow) -> str:
    if r.stopped_early:
        return f" (stopped {r.stopped_early.split(' by ')[0]})"
    return "" if r.status == "FINISHED" else f" ({r.status.lower()})"


def table_rows(report: Report) -> list[dict[str, Any]]:
    """The table's cells as display strings, in COLUMNS order."""
    out = []
    for r in report.rows:
        out.append(
            {
                "trial": r.trial + _trial_state(r),
                "workers": str(r.workers),
                "micro": str(r.micro),
                "accum": str(r.accum),
                "global_batch": str(r.global_batch),
                "effective_lr": f"{r.effective_lr:.4g}",
                "final_train_loss": f"{r.final_train_loss:.4f}",
                "best_val": f"{r.best_val:.4f} ({r.best_val_metric.split('/')[1]})",
                "samples_per_s": f"{r.samples_per_s:,.0f}",
                "peak_mem_mb": f"{r.peak_mem_mb:,.0f}",
                "sync_frac": f"{r.sync_frac:.1%}",
                "time_to_target_s": f"{r.time_to_target_s:.2f}",
                "wall_time_s": f"{r.wall_time_s:.1f}",
            }
        )
    return out
