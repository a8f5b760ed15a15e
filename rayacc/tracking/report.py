"""The comparison of a sweep's trials, from MLflow: a table (printed, CSV) and three plots."""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

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
    ("wall_time_s", "wall s"),
]


class ReportError(ValueError):
    pass


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


@dataclass
class Report:
    parent_run_id: str
    rows: list[TrialRow]
    loss_curves: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    """Trial label → (samples seen, train loss) per optimizer step."""
    files: list[Path] = field(default_factory=list)

    def per_micro(self, attr: str) -> dict[str, tuple[list[float], list[float]]]:
        """Worker count label → (micro-batch sizes, `attr` of each trial)."""
        series: dict[str, tuple[list[float], list[float]]] = {}
        for row in self.rows:
            xs, ys = series.setdefault(f"{row.workers} worker(s)", ([], []))
            xs.append(row.micro)
            ys.append(getattr(row, attr))
        return series


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def _resolve_parent(client, target: str) -> str:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(target).info.run_id
    except MlflowException:
        pass
    exp = client.get_experiment_by_name(target)
    if exp is None:
        raise ReportError(
            f"{target!r} is neither an MLflow run id nor an experiment name in this "
            "tracking store. Fix: pass the sweep's parent run id or its experiment"
        )
    runs = client.search_runs(
        [exp.experiment_id],
        filter_string="tags.`rayacc.sweep` = 'true'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    if not runs:
        raise ReportError(f"experiment {target!r} holds no sweep. Fix: run `rayacc sweep` first")
    return runs[0].info.run_id


def build_report(tracking_uri: str, target: str) -> Report:
    """Collects every child run of the sweep `target` (a parent run id, or an experiment: its
    latest sweep)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    parent_id = _resolve_parent(client, target)
    parent = client.get_run(parent_id)
    children = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
        order_by=["attributes.start_time ASC"],
    )
    if not children:
        raise ReportError(f"run {parent_id} has no child runs: is it a sweep's parent run?")
    report = Report(parent_id, [])
    for run in sorted(children, key=lambda r: int(r.data.tags.get("rayacc.trial", 0))):
        p, rid = run.data.params, run.info.run_id
        loss = _history(client, rid, "train/loss")
        samples = _history(client, rid, "train/samples")
        sps = [v for s, v in _history(client, rid, "train/samples_per_s") if s > 1]
        val_key = "val/accuracy" if _history(client, rid, "val/accuracy") else "val/loss"
        val = [v for _, v in _history(client, rid, val_key)]
        best = (max(val) if val_key == "val/accuracy" else min(val)) if val else math.nan
        mem = [v for _, v in _history(client, rid, "mem/peak_mb")]
        sync = [v for _, v in _history(client, rid, "comm/sync_time_frac")]
        end = run.info.end_time or run.info.start_time
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
            wall_time_s=(end - run.info.start_time) / 1000,
        )
        report.rows.append(row)
        seen, total = [], 0.0
        per_step = dict(samples)
        for step, _ in loss:
            total += per_step.get(step, 0.0)
            seen.append(total)
        report.loss_curves[f"{label}: {row.micro}×{row.accum}×{row.workers}"] = (
            seen,
            [v for _, v in loss],
        )
    return report


def _plot_xy(path: Path, title: str, xlabel: str, ylabel: str, series, scatter: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, (x, y) in series.items():
        if scatter:
            ax.plot(x, y, "o", label=label, markersize=7)
        else:
            ax.plot(x, y, label=label)
    if scatter:
        ax.set_xscale("log", base=2)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
            writer.writerow(asdict(row))
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
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri)
        for f in files:
            client.log_artifact(report.parent_run_id, str(f), "report")
    return files


def table_rows(report: Report) -> list[dict[str, Any]]:
    """The table's cells as display strings, in COLUMNS order."""
    out = []
    for r in report.rows:
        out.append(
            {
                "trial": r.trial + ("" if r.status == "FINISHED" else f" ({r.status.lower()})"),
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
                "wall_time_s": f"{r.wall_time_s:.1f}",
            }
        )
    return out
