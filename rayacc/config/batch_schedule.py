"""What changes a window's rows as the run goes. `batch.schedule`: the global batch as a
function of the samples trained (a batch-size warmup, Megatron's step schedule): from
`from_samples` (a token job: `from_tokens`) on, a phase's global batch; accumulation is
re-derived and the LR follows `optim.lr_scaling` at each phase. `batch.balance: auto`: the
ranks' shares of a window follow their measured time per row (worker/balance.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["EXCLUDES", "BatchPhase", "balance_rules", "schedule_rules"]

EXCLUDES = {
    "batch.grad_accum_steps": ("is derived per phase", "remove it"),
    "batch.micro_batch_size": ("auto searches one share before training", "give a size"),
    "train.strategy": (
        "the strategy's accumulation is fixed for a worker group",
        "use a strategy that re-derives it (ddp, fsdp)",
    ),
    "scaling.on_resize": (
        "keep_micro_batch makes the global batch follow the workers",
        "use keep_global_batch",
    ),
}
"""What a schedule cannot go with: (why, the fix), by the field named."""


class BatchPhase(BaseModel):
    """One phase of `batch.schedule`."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True
    )

    from_samples: int | None = Field(None, ge=1)
    """The samples trained (over all workers) from which this phase's global batch applies:
    the first window that starts at or past it runs at it."""
    from_tokens: int | None = Field(None, ge=1)
    """Instead of `from_samples`, for a token job: the tokens trained, a sample counting the
    input tokens of the data's longest row (its padded length); the phase starts at the
    first sample at or past it."""
    global_batch_size: int = Field(ge=1)
    """The global batch of this phase (`batch.global_batch_size` holds before the first)."""

    @model_validator(mode="after")
    def _one_start(self) -> BatchPhase:
        if (self.from_samples is None) == (self.from_tokens is None):
            raise ValueError("give one of from_samples and from_tokens")
        return self

    @property
    def unit(self) -> str:
        """The field it starts by: `from_samples` or `from_tokens`."""
        return "from_samples" if self.from_samples is not None else "from_tokens"

    def start(self, tokens_per_sample: int | None) -> int | None:
        """The sample it starts from (None: counted in tokens, and the data not known)."""
        if self.from_samples is not None:
            return self.from_samples
        return -(-self.from_tokens // tokens_per_sample) if tokens_per_sample else None


def schedule_rules(sections: dict) -> list:
    """What `batch.schedule` must be and cannot be combined with, as config issues."""
    from rayacc.config.batch_split import BatchSplitError, resolve_batch_split, split_for_workers
    from rayacc.config.errors import MISSING, ConfigIssue

    batch, scaling = sections.get("batch"), sections.get("scaling")
    train = sections.get("train")
    phases = getattr(batch, "schedule", None)
    if not phases:
        return []
    issues = []

    def refuse(path: str, problem: str, fix: str) -> None:
        issues.append(ConfigIssue(path, problem, MISSING, fix))

    units = {p.unit for p in phases}
    if len(units) > 1:
        refuse("batch.schedule", "its phases mix from_samples and from_tokens", "count in one")
    starts = [p.from_samples or p.from_tokens for p in phases]
    if len(units) == 1 and starts != sorted(set(starts)):
        refuse("batch.schedule", f"its phases' {units.pop()} do not increase", "order them")
    if batch.global_batch_size is None:
        refuse(
            "batch.global_batch_size",
            "is required with batch.schedule (it holds before the first phase)",
            "set it",
        )
    fixed = {
        "batch.grad_accum_steps": batch.grad_accum_steps is not None,
        "batch.micro_batch_size": batch.auto_micro_batch,
        "train.strategy": train is not None and _fixed_accumulation(train.strategy) is not None,
        "scaling.on_resize": scaling is not None
        and scaling.elastic
        and scaling.on_resize == "keep_micro_batch",
    }
    assert fixed.keys() == EXCLUDES.keys()
    for path, bad in fixed.items():
        if bad:
            problem, fix = EXCLUDES[path]
            if path == "train.strategy":
                problem = f"{train.strategy}: {_fixed_accumulation(train.strategy)}"
            refuse(path, f"{problem} (batch.schedule changes the global batch)", fix)
    if issues or scaling is None:
        return issues
    tp = train.tensor_parallel if train is not None else 1
    for i, phase in enumerate(phases):
        try:
            base = resolve_batch_split(
                num_workers=scaling.max_workers,
                tensor_parallel=tp,
                global_batch_size=phase.global_batch_size,
                micro_batch_size=batch.fixed_micro_batch_size,
                uneven=scaling.elastic,
            )
            if scaling.elastic:
                for workers in range(scaling.min_workers, scaling.max_workers):
                    split_for_workers(base, workers, scaling.on_resize)
        except BatchSplitError as exc:
            refuse(f"batch.schedule[{i}].global_batch_size", exc.problem, exc.fix)
    return issues


def _fixed_accumulation(strategy: str) -> str | None:
    from rayacc.config.strategies import strategies

    entry = strategies().get(strategy)
    return entry.fixed_accumulation if entry is not None else None


def balance_rules(sections: dict) -> list:
    """`batch.balance: auto` needs a strategy whose accumulation may change within a group
    (moving rows may change the micro-steps of a window)."""
    from rayacc.config.errors import MISSING, ConfigIssue

    batch, train = sections.get("batch"), sections.get("train")
    if getattr(batch, "balance", "off") != "auto" or train is None:
        return []
    if (why := _fixed_accumulation(train.strategy)) is None:
        return []
    return [
        ConfigIssue(
            "batch.balance",
            f"auto moves rows between ranks, which may change a window's micro-steps; "
            f"{train.strategy}: {why}",
            MISSING,
            "set batch.balance=off, or use a strategy that re-derives it (ddp, fsdp)",
        )
    ]
