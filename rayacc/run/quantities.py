"""Quantities derived from a config, in one place: the batch split at a worker count, the
effective LR and how it was derived, the train/validation split, the epoch layout and the number
of optimizer steps. `run/spec.py::RunSpec` holds them for one run."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass

import numpy as np

from rayacc.config import TrainConfig
from rayacc.config.batch_schedule import FOLLOW_EVERY, auto_sizes, declared_batches
from rayacc.config.batch_split import BatchSplit, BatchSplitError, split_for_workers
from rayacc.data.order import DataOrder, EpochLayout
from rayacc.data.sources import DatasetInfo, RowGroups
from rayacc.engine.lr import effective_lr
from rayacc.engine.parallel import strategy_class, strategy_classes
from rayacc.engine.random_state import rank_seed
from rayacc.optim import optimizer_slots
from rayacc.redact import redact

__all__ = [
    "IDENTITY_FIELDS",
    "Phase",
    "RunLength",
    "batch_phases",
    "data_order",
    "elastic_summary",
    "epoch_layout",
    "lr_explanation",
    "order_kind",
    "phase_sizes",
    "phases_summary",
    "pipeline_in_flight",
    "rank_seed",
    "remaining_epochs",
    "run_effective_lr",
    "run_identity",
    "schedule_length",
    "split_at",
    "total_optimizer_steps",
    "windows_left",
    "worker_splits",
]


def split_at(cfg: TrainConfig, num_workers: int) -> BatchSplit:
    """The batch split a group of `num_workers` runs: an elastic run follows `scaling.on_resize`
    from the split at the most workers; a fixed-size run resolves the config at that count."""
    if cfg.scaling.elastic:
        return split_for_workers(
            cfg.batch_split(),
            num_workers,
            cfg.scaling.on_resize,
            cfg.batch.micro_batch_by_workers,
        )
    return cfg.batch_split(num_workers=num_workers)


def worker_splits(cfg: TrainConfig) -> dict[int, BatchSplit | BatchSplitError]:
    """The batch split at each worker count the run may run at, or why it cannot run there."""
    splits: dict[int, BatchSplit | BatchSplitError] = {}
    for workers in range(cfg.scaling.min_workers, cfg.scaling.max_workers + 1):
        try:
            splits[workers] = split_at(cfg, workers)
        except BatchSplitError as exc:
            splits[workers] = exc
    return splits


@dataclass(frozen=True)
class Phase:
    """A phase of `batch.schedule` as the run takes it: from which sample on (None: where
    `auto` moves to it), and its split and effective LR at each worker count it may run at."""

    from_samples: int | None
    global_batch_size: int
    splits: dict[int, BatchSplit | BatchSplitError]
    lrs: dict[int, float]


def tokens_per_sample(info: DatasetInfo) -> int | None:
    """The tokens a sample counts for `batch.schedule`'s `from_tokens`: the input tokens of
    the data's longest row (its padded length); None for rows that are not tokens."""
    return info.max_tokens - 1 if info.format == "tokens" and info.max_tokens > 1 else None


def check_batches(cfg: TrainConfig, info: DatasetInfo, rows: int) -> None:
    """Raises DataError where the data cannot run the declared batches: one larger than the
    `rows` of training data (no step would see it, MLflow would record it), a schedule's
    `from_tokens` on rows that are not tokens or two of them in the same sample."""
    from rayacc.data.common import DataError

    where = f"data.source {info.path}"
    base = ("batch.global_batch_size", cfg.batch_split().global_batch_size)
    field, g = max([base, *declared_batches(cfg.batch)], key=lambda b: b[1])
    if rows < g:
        raise DataError(
            f"{field}={g} is more than the {rows} training rows of {where} (after "
            f"data.val_fraction={cfg.data.val_fraction}): no step sees it. Fix: set {field} to "
            f"at most {rows}, lower data.val_fraction, or add data"
        )
    per_sample = tokens_per_sample(info)
    listed = cfg.batch.schedule if cfg.batch.schedule != "auto" else []
    starts = [p.start(per_sample) for p in listed if p.from_tokens is not None]
    if starts and per_sample is None:
        raise DataError(
            f"batch.schedule[0].from_tokens counts tokens, and {where} holds {info.format} "
            "rows. Fix: count the phases in from_samples"
        )
    if len(set(starts)) < len(starts):
        raise DataError(
            f"batch.schedule: two phases' from_tokens fall in one sample of {per_sample} "
            f"tokens ({where}). Fix: set them at least {per_sample} tokens apart"
        )


def batch_phases(cfg: TrainConfig, per_sample: int | None) -> tuple[Phase, ...]:
    """The phases of `batch.schedule` (the configured global batch holds before the first),
    each derived as a job of its global batch would be; `per_sample`: `tokens_per_sample`."""
    phases = []
    # the LR's base stays the configured batch where `optim.base_batch_size` is omitted
    base = cfg.optim.base_batch_size or cfg.batch.global_batch_size
    optim = cfg.optim.model_copy(update={"base_batch_size": base})
    auto = cfg.batch.schedule == "auto"
    starts = [(None, g) for g in auto_sizes(cfg.batch)] if auto else [
        (p.start(per_sample), p.global_batch_size) for p in cfg.batch.schedule
    ]  # fmt: skip
    for start, size in starts:
        batch = cfg.batch.model_copy(update={"global_batch_size": size, "schedule": []})
        at = cfg.model_copy(update={"batch": batch, "optim": optim})
        splits = worker_splits(at)
        lrs = {w: run_effective_lr(at, s) for w, s in splits.items() if isinstance(s, BatchSplit)}
        phases.append(Phase(start, size, splits, lrs))
    return tuple(phases)


def phases_summary(cfg: TrainConfig, phases: tuple[Phase, ...] | None = None) -> list[str]:
    """A line for each phase of `batch.schedule` (`phases`: the run's, or derived without the
    data): from which sample (or token, and its sample where the data is known), its split at
    the most workers and its effective LR."""
    lines = []
    phases = batch_phases(cfg, None) if phases is None else phases
    listed = cfg.batch.schedule
    if listed == "auto":
        listed = [None] * len(phases)
        lines.append(
            f"batch schedule: auto — from global batch {cfg.batch.global_batch_size}, doubled "
            "while the gradient noise scale is at least twice it, halved while it is under half, "
            f"at most once in {FOLLOW_EVERY} windows; each size:"
        )
    for p, phase in zip(listed, phases, strict=True):
        split = phase.splits[cfg.scaling.max_workers]
        if not isinstance(split, BatchSplit):
            continue
        lr = phase.lrs[cfg.scaling.max_workers]
        if p is None:
            at = "auto"
        elif p.from_tokens is None:
            at = f"from sample {p.from_samples}"
        else:
            known = f" (sample {phase.from_samples})" if phase.from_samples is not None else ""
            at = f"from token {p.from_tokens}{known}"
        lines.append(f"batch schedule: {at}, {split.describe()}, effective LR {lr:.6g}")
    return lines


def elastic_summary(cfg: TrainConfig, splits: dict[int, BatchSplit | BatchSplitError]) -> str:
    """Which worker counts of an elastic run keep the global batch (or what they do instead),
    from its `worker_splits`; raises BatchSplitError when none can run."""
    lo, hi, policy = cfg.scaling.min_workers, cfg.scaling.max_workers, cfg.scaling.on_resize
    ok = {w: p for w, p in splits.items() if isinstance(p, BatchSplit)}
    bad = {w: e.problem for w, e in splits.items() if isinstance(e, BatchSplitError)}
    if not ok:
        raise BatchSplitError(
            "scaling.num_workers",
            f"no worker count in [{lo}, {hi}] can run under {policy}",
            next(iter(bad.values())),
        )
    parts = [
        f"{w} → {'shares ' + '+'.join(map(str, p.shares)) + ', ' if p.shares else ''}"
        f"micro {p.micro_batch_size} × accum {p.grad_accum_steps}, global {p.global_batch_size}"
        for w, p in ok.items()
    ]
    text = f"elastic run [{lo}, {hi}] ({policy}): " + "; ".join(parts)
    if bad:
        text += (
            f". Not at {', '.join(map(str, bad))} worker(s): {next(iter(bad.values()))};"
            " a restart at such a size stops with that message"
        )
    return text


def run_effective_lr(cfg: TrainConfig, split: BatchSplit) -> float:
    """`optim.lr` rescaled from `optim.base_batch_size` to the split's global batch."""
    return effective_lr(
        cfg.optim.lr, split.global_batch_size, cfg.optim.base_batch_size, cfg.optim.lr_scaling
    )


def lr_explanation(cfg: TrainConfig, split: BatchSplit) -> str:
    """E.g. `effective LR 0.006 = 0.003 × linear(256/128)`."""
    base = cfg.optim.base_batch_size or split.global_batch_size
    return (
        f"effective LR {run_effective_lr(cfg, split):.6g} = {cfg.optim.lr:g} × "
        f"{cfg.optim.lr_scaling}({split.global_batch_size}/{base})"
    )


def order_kind(cfg: TrainConfig, info: DatasetInfo) -> str:
    """`chunks` or `rows`: `data.order`, with `auto` decided by the data's size."""
    if cfg.data.order != "auto":
        return cfg.data.order
    return "rows" if info.data_bytes <= cfg.data.exact_order_max_mb * 2**20 else "chunks"


def data_order(cfg: TrainConfig, info: DatasetInfo, groups: RowGroups) -> DataOrder:
    """The run's data order: training/validation split and each epoch's order."""
    d = cfg.data
    if order_kind(cfg, info) == "rows":
        return DataOrder.by_rows(info.num_rows, d.val_fraction, cfg.seed, d.shuffle)
    return DataOrder(groups.start, groups.size, cfg.seed, d.shuffle, d.val_fraction, chunked=True)


@dataclass(frozen=True)
class RunLength:
    """What bounds a run's length, read once from its config: `train.max_steps`,
    `train.epochs` and how an epoch's last window is cut (`data.last_window`)."""

    max_steps: int | None
    epochs: int | None
    last_window: str

    @classmethod
    def of(cls, cfg: TrainConfig) -> RunLength:
        return cls(cfg.train.max_steps, cfg.train.epochs, cfg.data.last_window)

    @property
    def epoch_bound(self) -> int | None:
        """The epochs the run may take: `train.epochs` where given; otherwise one, or with
        `train.max_steps` as many as it needs (None)."""
        if self.epochs is not None:
            return self.epochs
        return None if self.max_steps else 1


def epoch_layout(length: RunLength, rows: int, split: BatchSplit) -> EpochLayout:
    """How `rows` rows of an epoch split into windows of the split's global batch."""
    return EpochLayout(
        rows,
        split.global_batch_size,
        split.micro_batch_size,
        split.data_parallel,
        length.last_window,
        split.shares,
    )


@dataclass(frozen=True)
class EpochWindows:
    """The windows one rank runs in one epoch: the layout over the rows left in it, how many
    steps, and this rank's positions of each window (`lo[k]`, `hi[k]`, in the epoch's order)."""

    epoch: int
    layout: EpochLayout
    steps: int
    lo: np.ndarray
    hi: np.ndarray


def remaining_epochs(
    length: RunLength,
    num_train_rows: int,
    state,
    split: BatchSplit,
    rank: int,
    until_samples: int | None = None,
) -> list[EpochWindows]:
    """Every window rank `rank` runs from `state` (a TrainState) on: per epoch with steps left,
    its layout over the rows left from the saved sample position (which a new global batch need
    not divide). An epoch with fewer rows left than a window takes (after a resize, say) has no
    window and is left out. Which positions a rank gets does not depend on the micro-batch,
    only how they are cut. `until_samples`: none after the window that reaches it (where the
    next phase of `batch.schedule` starts)."""
    out = []
    steps_left = (length.max_steps or 10**12) - state.optimizer_step
    if until_samples is not None:
        g = split.global_batch_size
        steps_left = min(steps_left, -(-(until_samples - state.samples_seen) // g))
    bound = length.epoch_bound
    epochs = itertools.count(state.epoch) if bound is None else range(state.epoch, bound)
    for epoch in epochs:
        if steps_left <= 0:
            break
        offset = state.epoch_sample_offset if epoch == state.epoch else 0
        layout = epoch_layout(length, num_train_rows - offset, split)
        steps = min(layout.steps_per_epoch, steps_left)
        if steps == 0:
            if offset == 0:
                break  # a whole epoch without a window: none after it has one either
            continue
        lo, hi = layout.rank_intervals(rank, steps)
        out.append(EpochWindows(epoch, layout, steps, lo + offset, hi + offset))
        steps_left -= steps
    return out


def phase_sizes(reference: BatchSplit, phases: tuple[Phase, ...]) -> list[tuple[int, int, int]]:
    """(from sample, global batch, micro-batch) of each phase of a listed schedule at the
    reference's workers, the configured one from 0 (`phases`: the run's, `batch_phases`)."""
    sizes = [(0, reference.global_batch_size, reference.micro_batch_size)]
    for p in phases:
        split = p.splits.get(reference.num_workers)
        micro = split.micro_batch_size if isinstance(split, BatchSplit) else None
        sizes.append((p.from_samples, p.global_batch_size, micro or reference.micro_batch_size))
    return sizes


def windows_left(
    length: RunLength, num_train_rows: int, state, phases: list[tuple[int, int, int]], ranks: int
) -> tuple[int, int | None]:
    """Optimizer steps from `state` to the run's end where the global batch follows `phases`
    ((from_samples, global batch, micro-batch) in order, the first from 0) over `ranks`
    data-parallel ranks, and the sample position where the last one starts (None: no step
    left)."""
    steps_left = (length.max_steps or 10**12) - state.optimizer_step
    samples, epoch, offset = state.samples_seen, state.epoch, state.epoch_sample_offset
    bound, steps, last = length.epoch_bound, 0, None
    while steps_left > 0 and (bound is None or epoch < bound):
        i = max(k for k, (start, *_) in enumerate(phases) if start <= samples)
        _, g, micro = phases[i]
        # the window's rows (not its micro-batches): micro-batches of 1 drop what does not divide
        layout = EpochLayout(num_train_rows - offset, g, micro, ranks, length.last_window)
        n = min(layout.steps_per_epoch, steps_left)
        if i + 1 < len(phases):  # the window that reaches the next phase is this phase's last
            n = min(n, -(-(phases[i + 1][0] - samples) // g))
        if n == 0:
            if offset == 0:
                break  # a whole epoch without a window: none after it has one either
            epoch, offset = epoch + 1, 0
            continue
        short = layout.short_window_rows if n > layout.full_windows else 0
        rows = min(n, layout.full_windows) * g + short
        last = samples + rows - (short or g)
        samples, offset = samples + rows, offset + rows
        steps, steps_left = steps + n, steps_left - n
        if n == layout.steps_per_epoch:
            epoch, offset = epoch + 1, 0
    return steps, last


def total_optimizer_steps(length: RunLength, layout: EpochLayout) -> int:
    """Steps of the whole run: `train.max_steps`, bounded by `train.epochs` epochs of `layout`
    where they are given (`RunLength.epoch_bound`)."""
    bound = length.epoch_bound
    if bound is None:  # as many epochs as max_steps needs (none where an epoch has no window)
        return length.max_steps if layout.steps_per_epoch else 0
    by_epochs = bound * layout.steps_per_epoch
    return min(length.max_steps, by_epochs) if length.max_steps else by_epochs


def schedule_length(length: RunLength, layout: EpochLayout) -> float:
    """The run's length for the LR schedule, which counts samples in units of the layout's
    global batch: the sample position where the last optimizer step starts, plus one. A short
    last window is a fraction of a step, so with one the length is fractional, and the LR
    reaches its end (`optim.min_lr_ratio` × peak for cosine) exactly at the last step."""
    g = layout.global_batch_size
    steps_before_last = total_optimizer_steps(length, layout) - 1
    epochs, rest = divmod(steps_before_last, layout.steps_per_epoch)
    # the steps of an epoch before its last one are whole windows
    epoch_samples = layout.full_windows * g + layout.short_window_rows
    return (epochs * epoch_samples + rest * g) / g + 1


IDENTITY_FIELDS = (
    "seed",
    "data.source",
    "data.val_fraction",
    "data.shuffle",
    "data.last_window",
    "data.seq_len",
    "model.",
    "train.precision",
    "train.strategy",
)
"""Config fields (a trailing dot: a whole section) that fix the data order and the model: a
resume must keep them. Anything else (epochs, max_steps, cadences, tracking, workers of an
elastic run) may change."""


def run_identity(cfg: TrainConfig, info: DatasetInfo) -> dict[str, object]:
    """What a checkpoint must match to be resumed: the identity fields and the dataset's
    fingerprint (Parquet files, sizes, row counts), as JSON reads them back."""
    identity: dict[str, object] = {
        key: value
        for key, value in cfg.flat().items()
        if any(key == f or (f.endswith(".") and key.startswith(f)) for f in IDENTITY_FIELDS)
    }
    identity["dataset (Parquet files, sizes, row counts)"] = info.fingerprint
    identity["data order"] = order_kind(cfg, info)
    if cfg.model.lora is not None and cfg.model.name == "hf" and cfg.model.hf.weights:
        from rayacc.models.lora import BASE_KEY, base_identity

        # the base is not in the checkpoints: its files are what the adapters belong to
        identity[BASE_KEY] = base_identity(cfg.model.hf.weights)
    # credentials are not identity (and a checkpoint must not hold them)
    return redact(json.loads(json.dumps(identity)))


def pipeline_in_flight(cfg: TrainConfig, workers: int) -> int:
    """The micro-batches whose activations a pipeline's first stage holds at once: GPipe the
    window's, the others up to the stages (1 without a pipeline)."""
    if cfg.mesh.pipeline == 1:
        return 1
    return cfg.mesh.in_flight(cfg.batch_split(workers).grad_accum_steps)


def memory_per_rank(
    cfg: TrainConfig,
    info: DatasetInfo,
    num_parameters: int,
    workers: int,
    trainable: int | None = None,
    keep: float = 1.0,
):
    """Estimated memory per rank (MiB) for each strategy: parameters, gradients and optimizer
    state (fp32, AdamW 2 slots, SGD with momentum 1; of the `trainable` parameters only, where
    a base is frozen), and activations of one micro-batch from a simple model of the `gpt` and
    `mlp` models (None for a factory model). Rows: (label, params, grads, optimizer, acts).
    Under the mesh's tensor degree T or pipeline degree P, the configured strategy's
    rows only, each rank holding and computing `keep` of the model (the planner's
    `TensorPlan.keep(T)`; a pipeline rank's largest share of the stages) and a pipeline's
    activations for the micro-batches its schedule holds in flight (GPipe: the window's; the
    others: up to P, on the first stage); a sharded state is split over the shard group (the
    data-parallel ranks over `fsdp.replicate`'s groups, counted as 1 where `auto` waits for
    the placement)."""
    mib = 4 / 2**20  # fp32 bytes per value, in MiB
    slots = optimizer_slots(cfg.optim)
    micro = cfg.batch.fixed_micro_batch_size
    tp, pp = cfg.mesh.tensor, cfg.mesh.pipeline
    in_flight = pipeline_in_flight(cfg, workers) if micro else 1
    acts = _activations_per_sample(cfg, info)
    acts = acts * micro * keep * in_flight / 2**20 if acts is not None and micro else None
    p = num_parameters * mib * keep
    share = 1.0 if trainable is None else trainable / max(1, num_parameters)
    alone = tp == 1 and pp == 1
    classes = strategy_classes().values() if alone else [strategy_class(cfg.train.strategy)]
    mesh = (f" × tp {tp}" if tp > 1 else "") + (f" × pp {pp}" if pp > 1 else "")
    replicate = cfg.fsdp.replicate if isinstance(cfg.fsdp.replicate, int) else 1
    shards = max(1, workers // (tp * pp) // replicate)
    return [
        (label + mesh, params, grads * share, state * share, a)
        for cls in classes
        for label, params, grads, state, a in cls.memory_rows(
            p, shards, slots, acts, pipelined=pp > 1
        )
    ]


def _activations_per_sample(cfg: TrainConfig, info: DatasetInfo) -> float | None:
    """Bytes autograd keeps per sample in a forward: for `gpt`, per block about
    seq × width × (17 + 2.5 × heads × seq / width) values (Korthikanti et al.'s count, fp32),
    plus the logits and their softmax; activation checkpointing keeps each recomputed block's
    input only (plus one block's worth during its recompute)."""
    m, values = cfg.model, 0.0
    if m.name == "mlp":
        values = 2.0 * (sum(m.hidden_sizes) + info.num_classes) + info.num_features
    elif m.name == "gpt":
        seq, width = min(m.block_size, max(info.max_tokens - 1, 1)), m.n_embd
        block = seq * width * (17 + 2.5 * m.n_head * seq / width)
        setting = cfg.train.activation_checkpointing
        every = 0 if setting == "none" else 1 if setting == "full" else setting.every_n
        kept = m.n_layer if not every else m.n_layer - len(range(0, m.n_layer, every))
        recomputed = m.n_layer - kept
        values = kept * block + recomputed * seq * width + (block if recomputed else 0)
        chunk = cfg.train.loss_chunk_tokens
        values += 2 * min(seq, chunk or seq) * info.vocab_size + 2 * seq * width
    else:
        return None
    return 4.0 * values
