"""PLAN.yaml: what `rayacc plan --search` chose, and every candidate's predicted and measured
figures; `rayacc train --plan` and a sweep's `from_plan` read it back.

A plan holds for the job it was made for: the fields that change memory or speed per sample
(`made_for`) are compared with the job it is applied to, and a difference is an error that
names them (make the plan again). The global batch is the plan's invariant: every candidate
keeps it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rayacc.config import ConfigError, TrainConfig
from rayacc.config.errors import ConfigIssue
from rayacc.config.loader import read_yaml
from rayacc.config.rules import strategy_resets
from rayacc.planner.candidates import Candidate
from rayacc.redact import redact

__all__ = ["PLAN_VERSION", "PlanFile", "made_for"]

PLAN_VERSION = 1


def made_for(cfg: TrainConfig) -> dict[str, Any]:
    """The job's fields a plan depends on (dotted keys), masked as PLAN.yaml holds them (a
    presigned `data.source` is compared without its signature)."""
    return redact(
        {
            "model": cfg.model.model_dump(mode="json"),
            "data.source": cfg.data.source,
            "data.seq_len": cfg.data.seq_len,
            "global_batch_size": cfg.batch_split().global_batch_size,
            "train.precision": cfg.train.precision,
            "train.loss_chunk_tokens": cfg.train.loss_chunk_tokens,
            "optim.name": cfg.optim.name,
            "scaling.use_gpu": cfg.scaling.use_gpu,
        }
    )


@dataclass
class PlanFile:
    job: str | None
    made_for: dict[str, Any]
    chosen: Candidate
    by_workers: dict[int, Candidate]
    """The best candidate with the chosen strategy and checkpointing at each worker count
    (an elastic run resizes to it)."""
    candidates: list[dict[str, Any]] = field(default_factory=list)
    """Every candidate's row of the table, best first."""
    profile: dict[str, Any] = field(default_factory=dict)
    """What the prior was made of (planner/profile.py), measured on the worker group."""

    # ------------------------------------------------------------------ writing
    def to_yaml(self) -> str:
        doc = {
            "rayacc_plan": PLAN_VERSION,
            "job": self.job,
            "made_for": self.made_for,
            "chosen": {"label": self.chosen.label, **self.chosen.to_dict()},
            "overrides": self.chosen.overrides(),
            "by_workers": {n: c.to_dict() for n, c in sorted(self.by_workers.items())},
            "candidates": self.candidates,
            "profile": self.profile,
        }
        head = (
            "# written by `rayacc plan --search`; run it with "
            f"`rayacc train -c {self.job or 'JOB.yaml'} --plan THIS_FILE`\n"
        )
        # written through the one matcher, as every file rayacc writes
        return redact(head + yaml.safe_dump(doc, sort_keys=False, width=100, allow_unicode=True))

    def write(self, path: str | os.PathLike) -> Path:
        """Written whole or not at all (a temporary file renamed into place)."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.tmp")
        tmp.write_text(self.to_yaml())
        os.replace(tmp, p)
        return p

    # ------------------------------------------------------------------ reading
    @classmethod
    def read(cls, path: str | os.PathLike) -> PlanFile:
        raw = read_yaml(path, "plan", "-c PLAN.yaml from `rayacc plan --search --out PLAN.yaml`")
        fix = "make it again: rayacc plan -c JOB.yaml --search --out PLAN.yaml"
        if not isinstance(raw, dict) or raw.get("rayacc_plan") != PLAN_VERSION:
            raise ConfigError(
                [
                    ConfigIssue(
                        "rayacc_plan", f"not a rayacc plan of version {PLAN_VERSION}", fix=fix
                    )
                ],
                str(path),
            )
        try:
            return cls(
                job=raw.get("job"),
                made_for=dict(raw["made_for"]),
                chosen=Candidate.from_dict(raw["chosen"]),
                by_workers={int(n): Candidate.from_dict(c) for n, c in raw["by_workers"].items()},
                candidates=list(raw.get("candidates") or []),
                profile=dict(raw.get("profile") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(
                [ConfigIssue(str(exc).strip("'"), "missing or malformed", fix=fix)], str(path)
            ) from None

    def overrides_for(self, job: TrainConfig, source: str | None = None) -> list[str]:
        """The `key=value` overrides that run this plan on `job` (its own overrides applied):
        the chosen candidate, or for an elastic job (scaling.num_workers [min, max]) its
        strategy and checkpointing with each worker count's micro-batch. Raises ConfigError
        when the plan was made for another job."""
        self.check_job(job, source)
        c = self.chosen
        resets = strategy_resets(job, c.strategy)  # the job's settings for another strategy
        if not job.scaling.elastic:
            return [f"{k}={_flow(v)}" for k, v in {**resets, **c.overrides()}.items()]
        lo, hi = job.scaling.min_workers, job.scaling.max_workers
        sizes = {n: p.micro_batch_size for n, p in self.by_workers.items() if lo <= n <= hi}
        top = self.by_workers.get(hi, c)
        out = resets | {
            k: v
            for k, v in top.overrides(with_workers=False).items()
            if k != "batch.grad_accum_steps"  # derived at each size
        }
        out["batch.micro_batch_by_workers"] = sizes
        return [f"{k}={_flow(v)}" for k, v in out.items()]

    def check_job(self, job: TrainConfig, source: str | None = None) -> None:
        """Raises ConfigError naming each field where `job` differs from the plan's job."""
        mine = made_for(job)
        differ = [k for k, v in self.made_for.items() if mine.get(k) != v]
        if differ:
            raise ConfigError(
                [
                    ConfigIssue(
                        k,
                        f"the plan was made for {self.made_for[k]!r}, the job has {mine.get(k)!r}",
                        fix="make a plan for this job: rayacc plan -c JOB.yaml --search "
                        "--out PLAN.yaml",
                    )
                    for k in differ
                ],
                source,
            )

    def best(self, n: int) -> list[tuple[Candidate, dict[str, Any]]]:
        """The best `n` candidates that fit, with their table rows: measured fastest first,
        then the rest by predicted step time."""
        rows = [r for r in self.candidates if r.get("fits", True)]
        rows.sort(
            key=lambda r: (
                "measured_step_s" not in r,
                r.get("measured_step_s") or r.get("predicted_step_s") or float("inf"),
            )
        )
        return [(Candidate.from_dict(r), r) for r in rows[:n]]


def _flow(value: Any) -> str:
    """A value as an override's YAML text."""
    return (
        yaml.safe_dump(value, default_flow_style=True, width=10**6)
        .strip()
        .removesuffix("...")
        .strip()
    )
