"""`rayacc plan --search`: candidates → profile → prior → pruning → calibration of the best
within the time budget → one table → the choice, written to PLAN.yaml."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from rayacc.config import TrainConfig
from rayacc.config.mesh import Mesh
from rayacc.planner.candidates import (
    Candidate,
    checkpointing_choices,
    enumerate_candidates,
    rule_issues,
)
from rayacc.planner.planfile import PlanFile, made_for
from rayacc.planner.prior import PipelinePlan, Placement, Prediction, TensorPlan, predict
from rayacc.planner.profile import Profile

__all__ = [
    "PlanRow",
    "SearchResult",
    "format_table",
    "pick",
    "pipeline_plan",
    "pipeline_share",
    "profile_sizes",
    "search",
    "tensor_parallel_options",
    "tensor_plan",
]


@dataclass
class PlanRow:
    candidate: Candidate
    prediction: Prediction
    measured: dict[str, Any] | None = None
    """The calibration's result: status, memory_bytes, step_s."""

    @property
    def measured_ok(self) -> bool:
        return bool(self.measured) and self.measured.get("status") == "measured"

    @property
    def memory_error(self) -> float | None:
        if not self.measured_ok:
            return None
        return self.prediction.memory_bytes / self.measured["memory_bytes"] - 1

    @property
    def time_error(self) -> float | None:
        if not self.measured_ok:
            return None
        return self.prediction.step_s / self.measured["step_s"] - 1

    def to_dict(self, items_per_sample: float) -> dict[str, Any]:
        c, p = self.candidate, self.prediction
        out: dict[str, Any] = {"label": c.label, **c.to_dict()}
        out["predicted_memory_mb"] = _mb(p.memory_bytes)
        out["predicted_step_s"] = _round(p.step_s)
        out["fits"] = p.fits
        if p.why_not:
            out["pruned"] = p.why_not
        if self.measured:
            out["status"] = self.measured["status"]
            if "memory_bytes" in self.measured:
                out["measured_memory_mb"] = _mb(self.measured["memory_bytes"])
            if self.measured_ok:
                out["measured_step_s"] = _round(self.measured["step_s"])
                out["items_per_s"] = round(
                    c.global_batch_size * items_per_sample / self.measured["step_s"], 1
                )
        return out


def _mb(b: float) -> float | None:
    return None if b == float("inf") else round(b / 2**20, 2)


def _round(s: float) -> float | None:
    return None if s == float("inf") else float(f"{s:.4g}")


class NothingFits(ValueError):
    """No candidate fits the memory budget (by the prior, or as calibrated): the search has no
    plan to write."""


def nothing_fits(rows: list[PlanRow]) -> NothingFits | None:
    """The outcome when no candidate can run: none fits by the prior, or every one calibrated
    ran out of memory or over budget and none is left that the prior says fits; else None."""
    measured_fail = [r for r in rows if r.measured and not r.measured_ok]
    if any(r.measured_ok for r in rows):
        return None
    fitting = [r for r in rows if r.prediction.fits]
    if fitting and any(not r.measured for r in fitting):
        return None  # some fit by the prior and were not measured: the prior's word stands
    if fitting and not measured_fail:
        return None
    least = min(rows, key=lambda r: r.prediction.memory_bytes)
    why = least.prediction.why_not or (least.measured or {}).get("status", "over budget")
    return NothingFits(
        f"no candidate fits the memory budget: the smallest, {least.candidate.label}, {why}"
        f" ({len(rows)} candidates, {len(measured_fail)} calibrated out of memory or over "
        "budget); no plan written. Fix: raise batch.memory_budget (or batch.memory_budget_mb), "
        "allow more workers (scaling.num_workers), or use a smaller model or global batch"
    )


@dataclass
class SearchResult:
    rows: list[PlanRow]
    """Every candidate, best predicted first."""
    chosen: PlanRow
    profile: Profile
    skipped: list[str]
    timings: dict[str, float] = field(default_factory=dict)
    groups_started: int = 0

    @property
    def measured(self) -> list[PlanRow]:
        return [r for r in self.rows if r.measured_ok]

    def median_errors(self) -> tuple[float | None, float | None]:
        """Median |error| of memory and step time over the measured candidates."""
        rows = self.measured
        if not rows:
            return None, None
        return (
            statistics.median(abs(r.memory_error) for r in rows),
            statistics.median(abs(r.time_error) for r in rows),
        )

    def plan_file(self, cfg: TrainConfig) -> PlanFile:
        chosen = self.chosen.candidate
        same_kind = [
            r
            for r in self.rows
            if (
                r.candidate.strategy,
                r.candidate.grad_sync,
                r.candidate.checkpointing,
                r.candidate.mesh,
            )
            == (chosen.strategy, chosen.grad_sync, chosen.checkpointing, chosen.mesh)
            and r.prediction.fits
        ]
        by_workers: dict[int, Candidate] = {}
        for n in sorted({r.candidate.workers for r in same_kind}):
            at_n = [r for r in same_kind if r.candidate.workers == n]
            by_workers[n] = pick(at_n).candidate
        by_workers[chosen.workers] = chosen
        items = self.profile.items_per_sample
        return PlanFile(
            job=cfg.source_file,
            made_for=made_for(cfg),
            chosen=chosen,
            by_workers=by_workers,
            candidates=[r.to_dict(items) for r in self.rows],
            profile=self.profile.to_dict(),
        )


def pick(rows: list[PlanRow]) -> PlanRow:
    """The fastest measured candidate; without measurements the fastest predicted that fits."""
    measured = [r for r in rows if r.measured_ok]
    if measured:
        return min(measured, key=lambda r: (r.measured["step_s"], r.measured["memory_bytes"]))
    fitting = [r for r in rows if r.prediction.fits] or rows
    return min(fitting, key=lambda r: (r.prediction.step_s, r.prediction.memory_bytes))


def profile_sizes(micros: list[int], most: int = 3) -> list[int]:
    """Micro-batch sizes the profile measures: the smallest, the largest and a spread between
    (time and memory are interpolated between them)."""
    sizes = sorted(set(micros))
    if len(sizes) <= most:
        return sizes
    picks = {round(i * (len(sizes) - 1) / (most - 1)) for i in range(most)}
    return [sizes[i] for i in sorted(picks)]


def profile_for(profiles: dict[int, Profile], workers: int) -> Profile:
    """The profile measured nearest to `workers` (collectives are scaled from it)."""
    return profiles[min(profiles, key=lambda n: (abs(n - workers), -n))]


def tensor_plan(model, tokens: int, value_bytes: int) -> TensorPlan | None:
    """What `model`'s tensor-parallel plan splits (None: it declares none): its layers' share
    of the parameters, and the all-reduce each runs per micro-step with the width it carries
    (a row-split layer's output, a column-split layer's input), over `tokens` per sample."""
    from fnmatch import fnmatchcase

    from torch.distributed.tensor.parallel import RowwiseParallel

    from rayacc.engine.parallel.tensor import tp_plan

    try:
        plan = tp_plan(model)
    except ValueError:
        return None
    total = sum(p.numel() for p in model.parameters())
    split = allreduces = width = 0
    for name, module in model.named_modules():
        style = next((s for path, s in plan.items() if fnmatchcase(name, path)), None)
        if style is None or not hasattr(module, "in_features"):
            continue
        split += sum(p.numel() for p in module.parameters(recurse=False))
        allreduces += 1
        rows = isinstance(style, RowwiseParallel)
        width += module.out_features if rows else module.in_features
    return TensorPlan(split / total if total else 0.0, allreduces, tokens * width * value_bytes)


def pipeline_share(model, mesh) -> float:
    """The share of `model`'s parameters the fullest rank of the `mesh`'s pipeline holds: its
    stages' units over all of them (the tied head counted on the last stage too, as it is
    held)."""
    from rayacc.engine.parallel.pipeline import balanced_runs, stage_indices

    pp, v = mesh.pipeline, mesh.stages_per_rank
    units = model.pipeline_units()
    runs = balanced_runs(units, pp * v)
    held = [sum(units[u] for i in stage_indices(mesh.schedule, r, pp, v) for u in runs[i])
            for r in range(pp)]  # fmt: skip
    return max(held) / sum(p.numel() for p in model.parameters())


def pipeline_plan(model, tokens: int, value_bytes: int, most: int) -> PipelinePlan | None:
    """What cutting `model` into 2, 4, … stages (up to `most` workers and its units, the
    default schedule) leaves its fullest rank, and what a stage sends the next per sample:
    the hidden states of `tokens` at the token embedding's width (None: it declares no split,
    or no embedding to take the width from)."""
    from torch import nn

    if not callable(getattr(model, "pipeline_units", None)):
        return None
    units = len(model.pipeline_units())
    width = next((m.embedding_dim for m in model.modules() if isinstance(m, nn.Embedding)), 0)
    shares, p = {}, 2
    while p <= min(most, units):
        shares[p] = pipeline_share(model, Mesh(p))
        p *= 2
    if not shares or not width:
        return None
    return PipelinePlan(shares, tokens * width * value_bytes)


def judged_by_the_rules(cfg: TrainConfig, candidates: list[Candidate]) -> tuple[list, list]:
    """The candidates kept: each pipeline candidate the config's rules refuse for what its
    stages add (an issue the same candidate without them does not raise: a job whose batch
    follows a schedule, adapters…) is left out, with a line for each stage count and
    reason."""
    kept, refused = [], {}
    for c in candidates:
        if c.pipeline_parallel > 1:
            added = (
                rule_issues(cfg, c).items()
                - rule_issues(cfg, replace(c, pipeline_parallel=1)).items()
            )
            if added:
                (_, reason), *_ = sorted(added)
                refused.setdefault((c.pipeline_parallel, reason), c.label)
                continue
        kept.append(c)
    lines = [f"pipelines of {p} stages ({label} …): {reason}"
             for (p, reason), label in refused.items()]  # fmt: skip
    return kept, lines


def tensor_parallel_options(model, most: int) -> list[int]:
    """The tensor-parallel group sizes the model takes (`check_tensor_plan`: a plan, whole
    heads on each rank), powers of two up to `most` workers."""
    from rayacc.models import ModelError
    from rayacc.models.registry import check_tensor_plan

    sizes, t = [], 2
    while t <= most:
        try:
            check_tensor_plan(model, Mesh(tensor=t))
        except ModelError:
            pass
        else:
            sizes.append(t)
        t *= 2
    return sizes


def worker_counts(cfg: TrainConfig, cluster_holds: int | None) -> list[int]:
    """Within `scaling.num_workers` (a fixed count: 1 to it; [min, max]: min to max), at most
    what the cluster holds."""
    lo = cfg.scaling.min_workers if cfg.scaling.elastic else 1
    hi = cfg.scaling.max_workers
    if cluster_holds is not None:
        hi = max(min(hi, cluster_holds), lo)
    return list(range(lo, hi + 1))


def search(
    cfg: TrainConfig,
    prep,
    group,
    *,
    budget_s: float,
    top: int,
    cluster_holds: int | None = None,
    node_holds: int | None = None,
    micro_sizes: list[int] | None = None,
    measure_all: bool = False,
    say: Callable[[str], None] = print,
) -> SearchResult:
    """The search on calibration `group` (calibrate.CalibrationGroup). `measure_all`: calibrate
    every candidate that fits (the benchmark's exhaustive sweep), without a time budget.
    `node_holds`: the workers one node of the cluster holds (`scaling.workers_per_node` wins
    when set; neither: one node)."""
    from rayacc.engine.units import fsdp_blocks
    from rayacc.models.registry import build_on_meta

    t0 = time.time()
    g = prep.split.global_batch_size
    counts = worker_counts(cfg, cluster_holds)
    model = build_on_meta(cfg, prep.info)
    blocks = len(fsdp_blocks(model))
    placement = Placement(cfg.scaling.workers_per_node or node_holds, cfg.scaling.inter_node_gbps)
    tokens = min(cfg.data.seq_len, max(prep.info.max_tokens - 1, 1)) if prep.info.max_tokens else 1
    value_bytes = 2 if cfg.train.precision == "bf16" else 4
    plan = tensor_plan(model, tokens, value_bytes)
    stages = pipeline_plan(model, tokens, value_bytes, max(counts))
    candidates, skipped = enumerate_candidates(
        g,
        counts,
        blocks,
        micro_sizes=micro_sizes,
        job_strategy=cfg.train.strategy,
        workers_per_node=placement.workers_per_node,
        tensor_parallel=tensor_parallel_options(model, max(counts)) if plan else [],
        pipeline=list(stages.shares) if stages else [],
    )
    candidates, refused = judged_by_the_rules(cfg, candidates)
    skipped += refused
    if not candidates:
        raise ValueError(
            "no candidate keeps the global batch at "
            + ", ".join(str(n) for n in counts)
            + " workers: "
            + "; ".join(skipped)
        )
    sizes = profile_sizes([c.micro_batch_size for c in candidates])
    most = max(c.workers for c in candidates)
    say(
        f"{len(candidates)} candidates at global batch {g}; profiling on {most} worker(s) at "
        f"micro-batches {', '.join(map(str, sizes))}"
    )
    choices = checkpointing_choices(blocks)
    profiles = {most: group.profile(most, sizes, choices)}
    if most > 1 and any(c.workers == 1 for c in candidates):
        # one worker runs neither a DDP wrapper nor a collective, and where workers share a
        # node's cores or memory bandwidth it computes faster alone: a profile of its own
        say("profiling on 1 worker")
        profiles[1] = group.profile(1, sizes, choices)
    t_profile = time.time()
    bf16 = cfg.train.precision == "bf16" and cfg.fsdp.mixed_precision
    rows = [
        PlanRow(
            c,
            predict(
                c,
                profile_for(profiles, c.workers),
                reshard_after_forward=cfg.fsdp.reshard_after_forward,
                bf16_gathers=bf16,
                placement=placement,
                tensor_plan=plan,
                pipeline_plan=stages,
            ),
        )
        for c in candidates
    ]
    rows.sort(key=lambda r: (not r.prediction.fits, r.prediction.step_s, r.prediction.memory_bytes))
    fitting = [r for r in rows if r.prediction.fits]
    say(f"{len(fitting)} fit, {len(rows) - len(fitting)} pruned by the prior")
    chosen_rows = fitting if measure_all else fitting[:top]
    deadline = float("inf") if measure_all else t0 + budget_s
    by_key = {r.candidate.label: r for r in chosen_rows}
    # the best candidate's worker count first: the budget is spent where it matters most
    order: list[int] = []
    for r in chosen_rows:
        if r.candidate.workers not in order:
            order.append(r.candidate.workers)
    for n in order:
        todo = [(r.candidate.label, r.candidate) for r in chosen_rows if r.candidate.workers == n]
        say(f"calibrating {len(todo)} candidate(s) on {n} worker(s)")
        group.measure(n, todo, deadline)
    for key, result in group.results().items():
        if key in by_key:
            by_key[key].measured = result
    late = [r for r in chosen_rows if r.measured is None]
    if late:
        # a plan from fewer measurements than asked for is a different plan: said, not hidden
        say(
            f"the time budget ({budget_s:g} s) ran out with {len(chosen_rows) - len(late)} of "
            f"{len(chosen_rows)} candidates measured; to measure them all, raise --budget-s"
        )
    if (outcome := nothing_fits(rows)) is not None:
        raise outcome
    chosen = pick(fitting or rows)
    t_end = time.time()
    return SearchResult(
        rows,
        chosen,
        profiles[most],
        skipped,
        timings={
            "profile_s": t_profile - t0,
            "calibrate_s": t_end - t_profile,
            "total_s": t_end - t0,
        },
        groups_started=group.groups_started,
    )


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:+.0f}%"


def format_table(result: SearchResult, token_items: bool, limit: int | None = None) -> list[str]:
    """The table: candidate, predicted and measured memory and step time, error %, items/s.
    `limit`: at most this many rows not measured that fit, and 3 of those pruned (every
    measured one is shown; all are in PLAN.yaml)."""
    unit = "tokens/s" if token_items else "samples/s"
    head = (
        f"{'candidate':34} {'mem MiB pred':>12} {'meas':>9} {'err':>5} "
        f"{'step s pred':>11} {'meas':>9} {'err':>5} {unit:>10}  note"
    )
    # the widest label sets the first column (a ZeRO mode with offload is the longest)
    width = max([34, *(len(r.candidate.label) for r in result.rows)])
    head = f"{'candidate':{width}}" + head[34:]
    lines = [head]
    items = result.profile.items_per_sample
    quota = {"fits": limit, "pruned": None if limit is None else 3}
    hidden = {"fits": 0, "pruned": 0}
    for r in result.rows:
        kind = "fits" if r.prediction.fits else "pruned"
        if not r.measured and quota[kind] is not None:
            if quota[kind] == 0:
                hidden[kind] += 1
                continue
            quota[kind] -= 1
        lines.append(_table_row(result, r, items, width))
    if hidden["fits"]:
        lines.append(f"… and {hidden['fits']} more not measured (all in PLAN.yaml)")
    if hidden["pruned"]:
        lines.append(f"… and {hidden['pruned']} more pruned by the prior (all in PLAN.yaml)")
    return lines


def _table_row(result: SearchResult, r: PlanRow, items: float, width: int = 34) -> str:
    p, m = r.prediction, r.measured or {}
    meas_mem = f"{m['memory_bytes'] / 2**20:9.1f}" if "memory_bytes" in m else f"{'':>9}"
    meas_t = f"{m['step_s']:9.4f}" if r.measured_ok else f"{'':>9}"
    rate = (
        f"{r.candidate.global_batch_size * items / m['step_s']:10,.0f}"
        if r.measured_ok
        else f"{'':>10}"
    )
    if r is result.chosen:
        note = "← chosen"
    elif m and not r.measured_ok:
        note = m.get("status", "")
    elif p.why_not:
        note = f"pruned: {p.why_not}"
    else:
        note = "" if m else "not measured"
    inf = float("inf")
    pred_mem = f"{p.memory_bytes / 2**20:12.1f}" if p.memory_bytes != inf else f"{'-':>12}"
    pred_t = f"{p.step_s:11.4f}" if p.step_s != inf else f"{'-':>11}"
    return (
        f"{r.candidate.label:{width}} {pred_mem} {meas_mem} {_pct(r.memory_error):>5} "
        f"{pred_t} {meas_t} {_pct(r.time_error):>5} {rate}  {note}"
    ).rstrip()
