"""`rayacc report RUN`: one run's course — workers, global batch and accumulation over time,
with its events (resizes, preemption notices, resumes, micro-batch changes, stragglers)
marked; every rank's own time per window, a straggler's line marked — and where its wall time
went (`goodput/…`), from its MLflow record."""

from __future__ import annotations

import csv
import itertools
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from rayacc.observe.goodput import PARTS, describe
from rayacc.redact import redact
from rayacc.tracking.history import lineage_points
from rayacc.tracking.plots import legend_beside

__all__ = ["RunReport", "build_run_report", "write_run_report"]

SERIES = {
    "scaling/num_workers": "workers",
    "scaling/global_batch_size": "global batch",
    "scaling/grad_accum_steps": "accumulation",
}
EVENT_TAGS = {
    "rayacc.resizes": "resize",
    "rayacc.preemptions": "preemption",
    "rayacc.micro_batch_events": "micro-batch",
    "rayacc.stragglers": "straggler",
    "rayacc.batch_phases": "batch schedule",
    "rayacc.shares": "shares",
}
_STEP = re.compile(r"^step (\d+): (.*)$")
_RANK_OWN = re.compile(r"^rank_(\d+)/own_s$")
_STRAGGLER = re.compile(r"^rank (\d+) ")


@dataclass
class RunReport:
    run_id: str
    name: str
    steps: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    """Each step's time since the run's first step was logged."""
    series: dict[str, list[float]] = field(default_factory=dict)
    events: list[tuple[int, str, str]] = field(default_factory=list)
    """(step, kind, what) in step order."""
    goodput: dict[str, float] = field(default_factory=dict)
    ranks: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    """Rank → (step, its own time per window over the logging interval that ended there)."""
    files: list[Path] = field(default_factory=list)
    noise: list[tuple[int, float]] = field(default_factory=list)
    """(step, `grad/noise_scale`): the gradient noise scale, smoothed, where it was measured."""

    @property
    def stragglers(self) -> list[int]:
        """The ranks the run named stragglers."""
        named = (_STRAGGLER.match(what) for _, kind, what in self.events if kind == "straggler")
        return sorted({int(m.group(1)) for m in named if m})

    def lines(self) -> list[str]:
        """What the console says of the run."""
        out = [f"run {self.name} ({self.run_id}): {len(self.steps)} optimizer steps"]
        for key, label in SERIES.items():
            values = self.series.get(key) or []
            changes = [f"{values[0]:g}"] if values else []
            for a, b in itertools.pairwise(values):
                if b != a:
                    changes.append(f"{b:g}")
            if changes:
                out.append(f"  {label}: {' → '.join(changes)}")
        for step, kind, what in self.events:
            out.append(f"  step {step}: {kind}: {what}")
        if len(self.ranks) > 1:
            mean = {r: statistics.fmean(v for _, v in pts) for r, pts in self.ranks.items()}
            slowest = max(mean, key=mean.__getitem__)
            out.append(
                f"  ranks: {len(self.ranks)}; own time per window, mean over the run: median "
                f"{statistics.median(mean.values()) * 1000:.0f} ms, slowest rank {slowest} "
                f"{mean[slowest] * 1000:.0f} ms"
            )
        if self.noise:
            (first, a), (last, b) = self.noise[0], self.noise[-1]
            out.append(
                f"  gradient noise scale (B_simple, smoothed): {a:.4g} at step {first}, {b:.4g} "
                f"at step {last} (a global batch well above it gains little per sample)"
            )
        if self.goodput:
            out.append(f"  {describe(self.goodput)}")
        return out


def _time_at(steps: list[int], seconds: list[float], step: int) -> float:
    """When `step` ended (the first logged step at or after it)."""
    for s, t in zip(steps, seconds):
        if s >= step:
            return t
    return seconds[-1] if seconds else 0.0


def build_run_report(client, run) -> RunReport:
    """The report of `run` (an MLflow Run) from its step metrics and event tags."""
    rid = run.info.run_id
    report = RunReport(rid, run.data.tags.get("rayacc.run_name", run.info.run_name or rid))
    by_key = {key: lineage_points(client, run, key) for key in SERIES}
    first = by_key["scaling/num_workers"]
    report.steps = [m.step for m in first]
    t0 = min((m.timestamp for m in first), default=0)
    report.seconds = [(m.timestamp - t0) / 1000 for m in first]
    report.series = {key: [m.value for m in ms] for key, ms in by_key.items()}
    for tag, kind in EVENT_TAGS.items():
        for entry in filter(None, (run.data.tags.get(tag) or "").split("; ")):
            m = _STEP.match(entry)
            if m:
                report.events.append((int(m.group(1)), kind, m.group(2)))
    for step in filter(None, (run.data.tags.get("rayacc.resumed_at_steps") or "").split(",")):
        report.events.append((int(step), "resumed", "from the checkpoint of this step"))
    report.events.sort(key=lambda e: e[0])
    # the last fit's split (each fit logs its own at its last step)
    for key in (*PARTS, "wall_s", "fraction", "restarts", "steps_recomputed"):
        history = lineage_points(client, run, f"goodput/{key}")
        if history:
            report.goodput[key] = max(history, key=lambda m: (m.step, m.timestamp)).value
    if "fraction" not in report.goodput:
        report.goodput = {}
    noise = lineage_points(client, run, "grad/noise_scale")
    report.noise = [(m.step, m.value) for m in noise]
    for key in run.data.metrics:
        m = _RANK_OWN.match(key)
        if m:
            history = lineage_points(client, run, key)
            report.ranks[int(m.group(1))] = [(x.step, x.value) for x in history]
    return report


def write_run_report(report: RunReport, out_dir: str | Path) -> list[Path]:
    """steps.csv and scaling_over_time.png (three panels sharing the time axis, a dashed line
    at each event); ranks_over_time.png when the run logged its ranks' figures."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, png = out / "steps.csv", out / "scaling_over_time.png"
    with csv_path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "seconds", *SERIES.values()])
        for i, step in enumerate(report.steps):
            cells = [report.series[k][i] if i < len(report.series[k]) else "" for k in SERIES]
            writer.writerow([step, f"{report.seconds[i]:.2f}", *cells])
    fig, axes = plt.subplots(len(SERIES), 1, figsize=(7, 6), sharex=True)
    by_step: dict[int, list[str]] = {}
    for step, kind, _ in report.events:
        by_step.setdefault(step, []).append(kind)
    gaps = [b - a for a, b in itertools.pairwise(report.seconds)]
    typical = statistics.median(gaps) if gaps else 0.0
    # a pause far longer than a step: the group restarting (a failure, a resize, a reclaim)
    pauses = [
        (report.seconds[i], report.seconds[i + 1])
        for i, gap in enumerate(gaps)
        if gap > max(5 * typical, 2.0)
    ]
    for ax, (key, label) in zip(axes, SERIES.items(), strict=True):
        ax.step(report.seconds, report.series.get(key) or [], where="post")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0, top=max(report.series.get(key) or [1]) * 1.3)
        for lo, hi in pauses:
            ax.axvspan(lo, hi, color="tab:gray", alpha=0.2, linewidth=0)
        for step, kinds in by_step.items():
            at = _time_at(report.steps, report.seconds, step)
            colour = "tab:red" if "preemption" in kinds else "tab:blue"
            ax.axvline(at, linestyle="--", linewidth=1, color=colour)
    top = axes[0].get_ylim()[1]
    for step, kinds in by_step.items():
        at = _time_at(report.steps, report.seconds, step)
        label = redact(f"{step}: {', '.join(dict.fromkeys(kinds))}")
        axes[0].annotate(label, (at, top), fontsize=7, rotation=90, va="top", ha="right")
    for lo, hi in pauses:
        axes[0].annotate("restart", ((lo + hi) / 2, 0.1 * top), fontsize=7, ha="center")
    axes[-1].set_xlabel("seconds since the first step")
    axes[0].set_title(redact(f"run {report.name}: workers, global batch and accumulation"))
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    report.files = [csv_path, png]
    if report.ranks:
        report.files.append(_ranks_png(report, out / "ranks_over_time.png", plt))
    return report.files


def _ranks_png(report: RunReport, path: Path, plt) -> Path:
    """One line per rank: its own time per window (compute, data wait, optimizer) at each
    logging interval; a straggler's line red and thick, the others thin."""
    fig, ax = plt.subplots(figsize=(8.5, 3.5))
    slow = set(report.stragglers)
    many = len(report.ranks) > 16  # one legend entry per rank stops being readable
    for rank, points in sorted(report.ranks.items()):
        steps, values = zip(*points) if points else ((), ())
        marked = rank in slow
        ax.plot(
            steps,
            [v * 1000 for v in values],
            color="tab:red" if marked else None,
            linewidth=2.5 if marked else 1,
            alpha=1.0 if marked or not many else 0.4,
            label=f"rank {rank}" + (" (straggler)" if marked else "")
            if marked or not many
            else None,
        )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("own time per window (ms)\n(all but waiting for peers)", fontsize=9)
    ax.set_ylim(bottom=0)
    legend_beside(ax)
    ax.set_title(redact(f"run {report.name}: each rank's own time"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
