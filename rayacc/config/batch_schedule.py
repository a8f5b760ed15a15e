"""What changes a window's rows as the run goes. `batch.schedule`: the global batch as a
function of the samples trained (a batch-size warmup, Megatron's step schedule): from
`from_samples` (a token job: `from_tokens`) on, a phase's global batch; or `auto`: it follows
the gradient noise scale in powers of two within `batch.min_global_batch_size` /
`max_global_batch_size`; accumulation is re-derived and the LR follows `optim.lr_scaling` at
each phase. `batch.balance: auto`: the ranks' shares of a window follow their measured time
per row (worker/balance.py); which strategies and degrees these go with, config/features.py
declares."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rayacc.config.mesh import Mesh

__all__ = [
    "EXCLUDES",
    "FOLLOW_EVERY",
    "BatchPhase",
    "auto_sizes",
    "declared_batches",
    "schedule_rules",
]

FOLLOW_EVERY = 10
"""`batch.schedule: auto` moves at most once in this many windows (the noise scale's smoothing
remembers about as many: each move waits for estimates made at the batch it chose)."""

EXCLUDES = {
    "batch.grad_accum_steps": ("is derived per phase", "remove it"),
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


def auto_sizes(batch) -> list[int]:
    """The global batches `batch.schedule: auto` may run (a BatchConfig's): the configured one
    times the powers of two within min / max (empty where they do not hold it)."""
    g, lo = batch.global_batch_size, batch.min_global_batch_size
    lo, hi = lo or g, batch.max_global_batch_size or g
    if g is None or not lo <= g <= hi:
        return []
    while lo < g and g % 2 == 0 and g // 2 >= lo:
        g //= 2
    sizes = [g]
    while sizes[-1] * 2 <= hi:
        sizes.append(sizes[-1] * 2)
    return sizes


def declared_batches(batch) -> list[tuple[str, int]]:
    """The global batches a BatchConfig's schedule declares besides the configured one, each
    named by the field that brings it: a listed phase's, or a size `auto` may run."""
    if batch.schedule == "auto":
        g = batch.global_batch_size
        return [
            (f"batch.{'min' if size < g else 'max'}_global_batch_size", size)
            for size in auto_sizes(batch)
            if size != g
        ]
    at = "batch.schedule[{}].global_batch_size"
    return [(at.format(i), p.global_batch_size) for i, p in enumerate(batch.schedule)]


def _auto_rules(batch, scaling, train, refuse) -> None:
    """What `auto` needs (or, without it, that its bounds are not set)."""
    auto = batch.schedule == "auto"
    for bound in ("min_global_batch_size", "max_global_batch_size"):
        if getattr(batch, bound) is not None and not auto:
            refuse(f"batch.{bound}", "bounds batch.schedule: auto only", "remove it, or set it")
    if not auto:
        return
    if batch.max_global_batch_size is None:
        refuse("batch.max_global_batch_size", "is required with batch.schedule: auto", "set it")
    elif batch.global_batch_size is not None and not auto_sizes(batch):
        refuse(
            "batch.global_batch_size",
            "lies outside batch.min_global_batch_size / max_global_batch_size",
            "set it between them",
        )
    if train is not None and train.max_steps is not None:
        refuse(
            "train.max_steps",
            "counts steps whose sizes batch.schedule: auto chooses as it goes",
            "bound the run by train.epochs",
        )
    if scaling is not None and scaling.max_workers == 1:
        refuse(
            "scaling.num_workers",
            "one rank measures no gradient noise scale (batch.schedule: auto follows it)",
            "run 2 or more workers, or give batch.schedule its phases",
        )


def schedule_rules(sections: dict) -> list:
    """What `batch.schedule` must be and cannot be combined with, as config issues."""
    from rayacc.config.batch_split import BatchSplitError, resolve_batch_split, split_for_workers
    from rayacc.config.errors import MISSING, ConfigIssue

    batch, scaling = sections.get("batch"), sections.get("scaling")
    train = sections.get("train")
    issues = []

    def refuse(path: str, problem: str, fix: str) -> None:
        issues.append(ConfigIssue(path, problem, MISSING, fix))

    if batch is None:
        return []
    _auto_rules(batch, scaling, train, refuse)
    phases = batch.schedule
    if not phases:
        return issues
    if phases != "auto":
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
    # the strategy, a pipeline and `auto` micro-batches are pairs of features (features.py)
    fixed = {
        "batch.grad_accum_steps": batch.grad_accum_steps is not None,
        "scaling.on_resize": scaling is not None
        and scaling.elastic
        and scaling.on_resize == "keep_micro_batch",
    }
    assert fixed.keys() == EXCLUDES.keys()
    for path, bad in fixed.items():
        if bad:
            problem, fix = EXCLUDES[path]
            refuse(path, f"{problem} (batch.schedule changes the global batch)", fix)
    if issues or scaling is None or Mesh.of_sections(train).pipeline > 1:
        return issues
    mesh = Mesh.of_sections(train)
    for path, size in declared_batches(batch):
        try:
            base = resolve_batch_split(
                num_workers=scaling.max_workers,
                mesh=mesh,
                global_batch_size=size,
                micro_batch_size=batch.fixed_micro_batch_size,
                uneven=scaling.keeps_global_batch,
            )
            if scaling.elastic:
                for workers in range(scaling.min_workers, scaling.max_workers):
                    split_for_workers(base, workers, scaling.on_resize)
        except BatchSplitError as exc:
            refuse(path, f"its global batch {size}: {exc.problem}", exc.fix)
    return issues
