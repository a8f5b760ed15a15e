"""Batch arithmetic: global_batch_size = micro_batch_size × grad_accum_steps × num_workers.

Pure Python (no torch), so the config layer can validate with it; `rayacc.engine` re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rayacc.config.mesh import Mesh

__all__ = [
    "BatchSplit",
    "BatchSplitError",
    "data_parallel_ranks",
    "even_shares",
    "resolve_batch_split",
    "split_for_workers",
]

GLOBAL = "batch.global_batch_size"
MICRO = "batch.micro_batch_size"
ACCUM = "batch.grad_accum_steps"
WORKERS = "scaling.num_workers"


@dataclass(frozen=True)
class BatchSplit:
    """How one optimizer step's samples are split: over workers, then over micro-steps."""

    global_batch_size: int
    micro_batch_size: int
    grad_accum_steps: int
    num_workers: int
    tensor_parallel: int = 1
    """Workers per tensor-parallel group (each layer split over them)."""
    pipeline_parallel: int = 1
    """Pipeline stages: a pipeline's ranks (× its tensor-parallel groups) read one share."""
    shares: tuple[int, ...] = ()
    """Rows of a window per data-parallel rank where the global batch does not split evenly
    over them (an elastic run's size): `even_shares`; empty where every rank takes G / ranks."""

    @property
    def rank_shares(self) -> tuple[int, ...]:
        """Rows of a full window per data-parallel rank."""
        if self.shares:
            return self.shares
        return (self.global_batch_size // self.data_parallel,) * self.data_parallel

    @property
    def data_parallel(self) -> int:
        """The ranks the batch splits over: the workers, or their tensor-parallel groups."""
        return data_parallel_ranks(self.num_workers, self.model_parallel)

    @property
    def model_parallel(self) -> int:
        """Workers that hold one replica's parts and read one share (tensor × pipeline)."""
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def samples_per_worker(self) -> int:
        """Samples one worker (one tensor-parallel group) processes per optimizer step."""
        return self.micro_batch_size * self.grad_accum_steps

    def describe(self) -> str:
        if self.shares:
            return (
                f"global batch {self.global_batch_size} = {' + '.join(map(str, self.shares))} "
                f"rows over workers {self.num_workers} (micro ≤ {self.micro_batch_size} × accum "
                f"{self.grad_accum_steps}, the same on every rank)"
            )
        head = (
            f"global batch {self.global_batch_size} = micro {self.micro_batch_size} × "
            f"accum {self.grad_accum_steps} × "
        )
        if self.model_parallel == 1:
            return head + f"workers {self.num_workers}"
        tp, pp = self.tensor_parallel, self.pipeline_parallel
        groups = {(tp, 1): f"tensor-parallel groups of {tp}", (1, pp): f"pipelines of {pp} stages"}
        within = groups.get((tp, pp), f"groups of tensor {tp} × pipeline {pp}")
        return head + (
            f"data-parallel ranks {self.data_parallel} ({self.num_workers} workers in {within})"
        )


class BatchSplitError(ValueError):
    """An impossible batch configuration; names the field at fault and the nearest valid values."""

    def __init__(self, field: str, problem: str, fix: str):
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem}. Fix: {fix}")

    def __reduce__(self):
        # rebuilt from its parts where it is unpickled (an error crossing processes, as Ray
        # carries a worker's to the driver): the default would pass the message alone
        return type(self), (self.field, self.problem, self.fix)


def _multiples_near(value: int, unit: int) -> list[int]:
    lower = (value // unit) * unit
    upper = lower + unit
    return [m for m in (lower, upper) if m >= unit]


def _divisors_near(n: int, target: int) -> list[int]:
    """The closest divisors of n below and above target."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    below = [d for d in divisors if d <= target]
    above = [d for d in divisors if d >= target]
    return sorted({d for d in (below[-1] if below else None, above[0] if above else None) if d})


def _or(values: list[int]) -> str:
    return " or ".join(str(v) for v in values)


def even_shares(rows: int, ranks: int) -> tuple[int, ...]:
    """`rows` over `ranks` as evenly as they go, the first ranks one row more (the split of a
    window that `ranks` does not divide)."""
    base, extra = divmod(rows, ranks)
    return (base + 1,) * extra + (base,) * (ranks - extra)


def _uneven(g: int, micro: int, workers: int, ranks: int) -> BatchSplit:
    """G over `ranks` by `even_shares`: every rank runs as many micro-steps as the largest
    share needs at `micro`, each of at most `micro` rows (collectives pair up on every rank)."""
    shares = even_shares(g, ranks)
    micro = min(micro, shares[0])
    steps = -(-shares[0] // micro)
    if shares[-1] < steps:  # micro-batches of 1: the smaller shares would run an empty one
        raise BatchSplitError(
            MICRO,
            f"the global batch {g} over {workers} workers takes shares of {shares[0]} and "
            f"{shares[-1]} rows, which micro-batches of {micro} cannot run in the same number "
            "of micro-steps",
            f"set {MICRO} to 2 or more, or use sizes that divide {GLOBAL}={g}",
        )
    return BatchSplit(g, micro, steps, workers, shares=shares)


def data_parallel_ranks(workers: int, model_parallel: int) -> int:
    """The ranks among `workers` the batch splits over: a group of `model_parallel` (tensor ×
    pipeline) reads one share (a count it does not divide is refused by the rules)."""
    return max(1, workers // model_parallel)


def resolve_batch_split(
    *,
    num_workers: int,
    global_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    grad_accum_steps: int | None = None,
    mesh: Mesh | None = None,
    uneven: bool = False,
) -> BatchSplit:
    """Completes the batch split for `num_workers` workers (in tensor-parallel groups of
    `tensor_parallel`, each group one share).

    - global + micro: accumulation is derived (the usual case; it follows the worker count);
    - global + accum: the micro-batch is derived;
    - global alone: accumulation 1;
    - micro (+ accum, default 1) without global: the global batch is their product;
    - all three: they must agree.
    `uneven` (a run keeping its global batch at every size): a global batch the ranks do not divide
    is split by `even_shares` instead of refused. Raises :class:`BatchSplitError` naming the
    field and the nearest valid values.
    """
    _check_positive(num_workers, global_batch_size, micro_batch_size, grad_accum_steps)
    mesh = mesh or Mesh()
    tp, pp = mesh.tensor, mesh.pipeline
    ranks = _Ranks(mesh.data_parallel(num_workers), num_workers, mesh)
    g, w = global_batch_size, ranks.w
    if uneven and g is not None and g % w and g >= w and grad_accum_steps is None:
        largest = -(-g // w)
        if micro_batch_size is not None and micro_batch_size > largest:
            raise BatchSplitError(
                MICRO,
                f"{micro_batch_size} is larger than the largest worker's share of the global "
                f"batch ({GLOBAL}={g} over {ranks}: {' + '.join(map(str, even_shares(g, w)))})",
                f"set {MICRO} to at most {largest}",
            )
        split = _uneven(g, micro_batch_size or largest, num_workers, w)
    else:
        split = _resolve(ranks, global_batch_size, micro_batch_size, grad_accum_steps)
    return replace(split, num_workers=num_workers, tensor_parallel=tp, pipeline_parallel=pp)


@dataclass(frozen=True)
class _Ranks:
    """The count the batch splits over, as the messages name it."""

    w: int
    workers: int
    mesh: Mesh

    @property
    def factor(self) -> str:
        return WORKERS if self.group == 1 else "data-parallel ranks"

    @property
    def group(self) -> int:
        return self.mesh.model_parallel

    def __str__(self) -> str:
        if self.group == 1:
            return f"{WORKERS}={self.w}"
        degrees = " × ".join(self.mesh.setting(d) for d in ("tensor", "pipeline")
                             if getattr(self.mesh, d) > 1)  # fmt: skip
        return f"the data-parallel ranks ({WORKERS}={self.workers} / {degrees} = {self.w})"

    def share(self, g: int, per: int) -> str:
        if self.group == 1:
            return f"({GLOBAL}={g} / {self} = {per})"
        return f"({GLOBAL}={g} over {self}: {per})"

    @property
    def other_count(self) -> str:
        if self.group == 1:
            return "a worker count dividing"
        return f"a {WORKERS} whose groups of {self.group} divide"


def _resolve(
    r: _Ranks, global_batch_size: int | None, micro_batch_size, grad_accum_steps
) -> BatchSplit:
    w = r.w
    if global_batch_size is None:
        if micro_batch_size is None:
            raise BatchSplitError(
                GLOBAL,
                "neither batch.global_batch_size nor batch.micro_batch_size is set",
                "set batch.global_batch_size (and batch.micro_batch_size to derive accumulation)",
            )
        accum = grad_accum_steps or 1
        return BatchSplit(micro_batch_size * accum * w, micro_batch_size, accum, w)
    g = global_batch_size
    if g % w:
        raise BatchSplitError(
            GLOBAL,
            f"{g} does not split evenly over {r}",
            f"set {GLOBAL} to {_or(_multiples_near(g, w))}, or use {r.other_count} {g}",
        )
    if micro_batch_size is not None and grad_accum_steps is not None:
        return _all_three(g, micro_batch_size, grad_accum_steps, r)
    if micro_batch_size is not None:
        return _accum_from_micro(g, micro_batch_size, r)
    if grad_accum_steps is not None:
        return _micro_from_accum(g, grad_accum_steps, r)
    return BatchSplit(g, g // w, 1, w)


def _check_positive(*values: int | None) -> None:
    for name, value in zip((WORKERS, GLOBAL, MICRO, ACCUM), values):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise BatchSplitError(
                name, f"must be a positive integer, got {value!r}", f"set {name} >= 1"
            )


def _all_three(g: int, m: int, k: int, r: _Ranks) -> BatchSplit:
    w = r.w
    product = m * k * w
    if product != g:
        fix = f"remove {ACCUM} to derive it"
        if (g // w) % m == 0:
            fix += f" (it would be {g // w // m})"
        fix += f", or set {GLOBAL}={product}"
        raise BatchSplitError(
            GLOBAL,
            f"{g} != {MICRO} × {ACCUM} × {r.factor} = {m} × {k} × {w} = {product}",
            fix,
        )
    return BatchSplit(g, m, k, w)


def _accum_from_micro(g: int, m: int, r: _Ranks) -> BatchSplit:
    w = r.w
    per_worker = g // w
    share = r.share(g, per_worker)
    if m > per_worker:
        raise BatchSplitError(
            MICRO,
            f"{m} is larger than one worker's share of the global batch {share}",
            f"set {MICRO} to at most {per_worker}, e.g. {_or(_divisors_near(per_worker, m))}",
        )
    if per_worker % m:
        raise BatchSplitError(
            MICRO,
            f"{m} does not divide one worker's share of the global batch {share}, so {ACCUM} "
            "would not be whole",
            f"set {MICRO} to {_or(_divisors_near(per_worker, m))}, or {GLOBAL} to "
            f"{_or(_multiples_near(g, m * w))}",
        )
    return BatchSplit(g, m, per_worker // m, w)


def _micro_from_accum(g: int, k: int, r: _Ranks) -> BatchSplit:
    w = r.w
    per_worker = g // w
    share = r.share(g, per_worker)
    if per_worker % k:
        raise BatchSplitError(
            ACCUM,
            f"{k} does not divide one worker's share of the global batch {share}",
            f"set {ACCUM} to {_or(_divisors_near(per_worker, k))}, or {GLOBAL} to "
            f"{_or(_multiples_near(g, k * w))}",
        )
    return BatchSplit(g, per_worker // k, k, w)


def split_for_workers(
    base: BatchSplit, num_workers: int, on_resize: str, planned: dict[int, int] | None = None
) -> BatchSplit:
    """The split when an elastic run has `num_workers` workers; `base` is the split at its most.

    keep_global_batch: the global batch stays; accumulation is re-derived, and the micro-batch
    is `planned`'s for this count (`batch.micro_batch_by_workers`, from a plan), else the
    largest divisor of the worker's share not above the configured one; a count that does not
    divide it takes `even_shares` (`_uneven`).
    keep_micro_batch: micro-batch and accumulation stay; the global batch follows the workers.
    """
    if on_resize == "keep_micro_batch":
        return BatchSplit(
            base.samples_per_worker * num_workers,
            base.micro_batch_size,
            base.grad_accum_steps,
            num_workers,
        )
    g = base.global_batch_size
    micro = (planned or {}).get(num_workers)
    if g < num_workers:
        raise BatchSplitError(
            WORKERS,
            f"the global batch {g} cannot be kept at {num_workers} workers (a rank would have "
            "no rows)",
            f"use a [min, max] up to {g}, a global batch of at least {num_workers}, or "
            "scaling.on_resize=keep_micro_batch",
        )
    if g % num_workers:
        # uneven shares: the largest one's micro-steps on every rank, none above the micro-batch
        return _uneven(g, micro or base.micro_batch_size, num_workers, num_workers)
    per_worker = g // num_workers
    if micro is not None and per_worker % micro:
        raise BatchSplitError(
            "batch.micro_batch_by_workers",
            f"micro-batch {micro} at {num_workers} workers does not divide the worker's share "
            f"{per_worker} of the global batch {g}",
            "make the plan again for this job (rayacc plan --search), or remove the entry",
        )
    if micro is None:
        micro = max(d for d in range(1, base.micro_batch_size + 1) if per_worker % d == 0)
    return BatchSplit(g, micro, per_worker // micro, num_workers)
