"""Every check that needs the data, the run's storage or the cluster, made before the worker
group is asked for (the config's own rules are in `config/`; the engine asserts its own
invariants). A user mistake found here is an error naming the field or file and the fix
(exit status 2), never a failure inside the workers after Ray starts.

- `prepare`: the data (one streamed pass, `data/sources.py`), the model (built on the meta
  device), the batch split against the data, warnings and notes;
- `locate`: the run's name (`runs.locate_run`) and, on a resume, whether the latest checkpoint
  may be continued by this config (`check_resume`: its identity and global batch);
- `check_cluster`, once Ray runs: whether the cluster can ever hold the worker group.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayacc.config import TrainConfig
from rayacc.config.batch_split import BatchSplit
from rayacc.config.features import DataKind
from rayacc.config.mesh import Mesh
from rayacc.config.schema import RunConfig, ScalingConfig, TrainSection
from rayacc.data.common import DataError
from rayacc.data.instruct import check_cut
from rayacc.data.order import DataOrder, EpochLayout
from rayacc.data.sources import DatasetInfo, RowGroups, data_kind, read_source
from rayacc.driver.places import check_places
from rayacc.driver.runs import RunLocation, locate_run
from rayacc.engine.parallel import state_format_named
from rayacc.engine.units import fsdp_blocks
from rayacc.models import ModelError, build_on_meta
from rayacc.models.lora import trainable_count
from rayacc.models.registry import check_pipeline_split, check_tensor_plan
from rayacc.redact.origins import register_run
from rayacc.run.quantities import check_batches, data_order, elastic_summary
from rayacc.run.spec import ResumeTerms, RunSpec, derive_run
from rayacc.run.tags import finetune_tags

__all__ = [
    "Prepared",
    "ResourceError",
    "check",
    "check_cluster",
    "check_resources",
    "check_resume",
    "locate",
    "prepare",
    "read_factor",
    "workers_that_fit",
]


# ----------------------------------------------------------------------------- data and model
@dataclass
class Prepared:
    """What the checks before launch found: the run (derived once, handed to the workers), the
    model's size, and what to tell the user."""

    spec: RunSpec
    num_parameters: int
    warnings: list[str]
    notes: list[str] = field(default_factory=list)
    source_metadata: dict[bytes, bytes] = field(default_factory=dict)
    """The source's schema metadata, as the one read of the source found it (its vocabulary's
    kind and tokenizer)."""
    tags: dict[str, str] = field(default_factory=dict)
    """The fine-tuning a run does, for its record (`finetune_tags`)."""
    trainable_parameters: int | None = None
    """Adapters (`model.lora`): the parameters that train; None: all do."""

    # the run's own quantities, read through (derived once, in `derive_run`)
    @property
    def cfg(self) -> TrainConfig:
        return self.spec.cfg

    @property
    def info(self) -> DatasetInfo:
        return self.spec.info

    @property
    def groups(self) -> RowGroups:
        return self.spec.groups

    @property
    def split(self) -> BatchSplit:
        return self.spec.reference

    @property
    def effective_lr(self) -> float:
        return self.spec.effective_lr

    @property
    def layout(self) -> EpochLayout:
        return self.spec.layout

    @property
    def total_steps(self) -> int:
        return self.spec.total_steps


def check(cfg: TrainConfig, scope: str = "run") -> Prepared | None:
    """The one pre-launch validator of the commands: `run` (train, verify, a sweep's base):
    everything, returned as `prepare` resolves it; `plan`: everything but the pass over the
    data (places, the model factory, the data's kind from its schema); `submit`: what this
    machine can judge of a job the cluster runs (the URIs' schemes, the model factory's
    import: the project is uploaded)."""
    from rayacc.models.objective import OBJECTIVE_FIX
    from rayacc.models.registry import resolve_callable, resolve_factory

    if scope == "run":
        return prepare(cfg)
    check_places(cfg, here=scope == "plan")
    if scope == "plan" and (kind := data_kind(cfg.data.source, cfg.data.cache_dir,
                                              cfg.data.seq_len)) is not None:  # fmt: skip
        cfg.check_data_kind(kind)
    if cfg.model.name == "factory":
        resolve_factory(cfg.model.factory or "")
    if cfg.train.loss is not None:
        _check_objective(cfg, resolve_callable("train.loss", cfg.train.loss, OBJECTIVE_FIX))
    return None


def _check_objective(cfg: TrainConfig, fn, info: DatasetInfo | None = None) -> None:
    """What the user's objective declares and counts against the strategy and precision (a
    weighted count, or items other than rayacc's counter's, under an engine that counts
    first); `info`: the data's shape, where it is read."""
    from rayacc.config.strategies import strategy_entry
    from rayacc.models.objective import check_counts_ahead, check_weighted

    first = strategy_entry(cfg.train.strategy).counts_first
    check_weighted(cfg.train.loss or "", fn, cfg.train.precision, first)
    if info is not None:
        fp16 = "fp16's loss scale" if cfg.train.precision == "fp16" else None
        check_counts_ahead(cfg.train.loss or "", fn, info, first or fp16)


def prepare(cfg: TrainConfig) -> Prepared:
    """Resolves data, batch split, LR and model; raises DataError / ModelError / BatchSplitError
    (all ValueError) for user mistakes, PlaceError for every place it names that cannot be
    used."""
    # its secrets are known by where they come from before anything is written or printed
    register_run(cfg)
    check_places(cfg)
    source = read_source(cfg.data.source, cfg.data.cache_dir, cfg.data.seq_len)
    info, groups = source.info, source.groups
    model = build_on_meta(cfg, info)
    if info.documents and "documents" not in inspect.signature(model.forward).parameters:
        raise ModelError(
            f"data.source={info.path!r} holds packed rows (`documents`), and the model's "
            "forward takes no `documents` to keep each example's attention to itself. Fix: "
            "prepare the data without --pack, or give the forward a `documents` argument "
            "(rayacc.models.gpt.document_mask builds the mask)"
        )
    cfg.check_data_kind(DataKind(packed=info.documents, masked=info.loss_mask))
    check_cut(info.path, source.metadata, cfg.data.seq_len)
    if cfg.train.loss is not None:
        from rayacc.models.objective import OBJECTIVE_FIX
        from rayacc.models.registry import resolve_callable

        _check_objective(cfg, resolve_callable("train.loss", cfg.train.loss, OBJECTIVE_FIX), info)
    if cfg.mesh.tensor > 1:
        check_tensor_plan(model, cfg.mesh)
    if cfg.mesh.pipeline > 1:
        check_pipeline_split(model, cfg.mesh)
    order = data_order(cfg, info, groups)
    if len(order.train_units) == 0:
        raise DataError(
            f"data.val_fraction={cfg.data.val_fraction} holds out all {len(groups)} row "
            f"group(s) of {info.path} (data.order=chunks holds out whole row groups). Fix: "
            "write the data with smaller row groups (`rayacc data prepare`), set "
            "data.order=rows, or lower data.val_fraction"
        )
    split = cfg.batch_split()
    check_batches(cfg, info, order.num_train_rows)
    # from here on the run is read from its RunSpec, not from the config
    spec = derive_run(cfg, info, groups, order, split)
    reads = read_factor(order, spec.layout) if order.chunked else None
    trainable, total = trainable_count(model)
    return Prepared(
        spec,
        total,
        _warnings(spec, model, reads),
        [_order_note(spec, reads), *_notes(spec)],
        source.metadata,
        finetune_tags(spec, source.metadata, trainable, total),
        trainable if cfg.model.lora is not None else None,
    )


def read_factor(order: DataOrder, layout: EpochLayout) -> float:
    """Rows the cluster reads in the first epoch over rows trained on (data.order=chunks: a
    row group that two ranks' shares straddle is read by both)."""
    read = 0
    for rank in range(layout.num_workers):
        lo, hi = layout.rank_intervals(rank)
        units, _ = order.units_of(0, lo, hi)
        read += int(order.unit_size[units].sum())
    return read / max(1, layout.num_rows - layout.dropped_rows)


def _order_note(spec: RunSpec, reads: float | None) -> str:
    info, groups = spec.info, spec.groups
    mib = info.data_bytes / 2**20
    if reads is None:
        what = "an exact per-row shuffle" if spec.cfg.data.shuffle else "the stored order"
        return f"data order: rows ({what}; every rank reads all {mib:.1f} MiB each epoch)"
    return (
        f"data order: chunks ({len(groups)} row groups of about "
        f"{info.num_rows / len(groups):.0f} rows, {mib:.1f} MiB); the cluster reads "
        f"{reads:.2f}× the rows it trains on per epoch"
    )


def _warnings(spec: RunSpec, model, reads: float | None) -> list[str]:
    cfg, layout, groups = spec.cfg, spec.layout, spec.groups
    warnings = []
    if cfg.data.materialize is not None:
        warnings.append(
            "data.materialize no longer has an effect: every rank reads its rows through Ray "
            "Data (remove the setting)"
        )
    if reads is not None and reads > 1.25:
        share = layout.global_batch_size // layout.num_workers
        warnings.append(
            f"data.order=chunks reads each row {reads:.2f}× per epoch: row groups of about "
            f"{int(groups.size.mean())} rows are large against each rank's {share} rows per "
            f"window. Fix: rewrite the data with row groups of at most {max(1, share // 4)} "
            "rows (`rayacc data prepare ... --rows-per-group N`), or use data.order=rows for "
            "data that fits in memory"
        )
    by_epochs = (cfg.train.epochs or 0) * layout.steps_per_epoch
    if cfg.train.epochs and cfg.train.max_steps and cfg.train.max_steps > by_epochs:
        warnings.append(
            f"train.max_steps={cfg.train.max_steps} exceeds train.epochs × steps per epoch = "
            f"{cfg.train.epochs} × {layout.steps_per_epoch}; stopping at {by_epochs} "
            "(raise train.epochs to run longer)"
        )
    if layout.dropped_rows:
        warnings.append(layout.describe())
    if cfg.train.activation_checkpointing != "none" and not fsdp_blocks(model):
        warnings.append(
            "train.activation_checkpointing is set but the model names no blocks (a `blocks` "
            "ModuleList or an `fsdp_blocks()` method): nothing is recomputed"
        )
    planned = cfg.batch.micro_batch_by_workers
    if planned and (not cfg.scaling.elastic or cfg.scaling.on_resize != "keep_global_batch"):
        warnings.append(
            "batch.micro_batch_by_workers is for elastic runs that keep the global batch "
            "(scaling.num_workers: [min, max], scaling.on_resize: keep_global_batch); this run "
            "ignores it (remove it, or make the run elastic)"
        )
    if crowded := local_oversubscription(cfg.scaling):
        warnings.append(crowded)
    warnings += spot_warnings(cfg.scaling, cfg.train)
    bn = batchnorm_layers(model)
    if bn:
        warnings.append(
            f"the model holds BatchNorm layers ({', '.join(bn[:3])}): their statistics come from "
            "each micro-batch, so accumulation is not equivalent to the big batch. Fix: use "
            "GroupNorm or LayerNorm"
        )
    return warnings


def spot_warnings(scaling: ScalingConfig, train: TrainSection) -> list[str]:
    """A run placed on spot capacity (`scaling.extra_resources: {spot: ...}`, the resource the
    cluster specs give spot nodes) that a reclaim would cost more than it must."""
    if not scaling.extra_resources.get("spot"):
        return []
    out = []
    if not scaling.elastic:
        out.append(
            f"scaling.num_workers={scaling.num_workers} on spot nodes: at each reclaim the "
            "run stops until the autoscaler has a replacement node. Fix: an elastic range, e.g. "
            f"scaling.num_workers=[1, {scaling.max_workers}], goes on with fewer workers"
        )
    if not train.checkpoint_on_preemption:
        every = train.checkpoint_every_steps
        lost = f"up to {every - 1}" if every else "all of them: none is written before the end"
        out.append(
            "train.checkpoint_on_preemption=false on spot nodes: a reclaim costs every step "
            f"since the last periodic checkpoint ({lost}). Fix: leave it on"
        )
    return out


def local_oversubscription(s: ScalingConfig) -> str | None:
    """The warning for a local run (rayacc starts Ray here) whose workers reserve more CPUs
    than this machine has: the local Ray is sized to hold them (driver.ensure_ray), so they
    share cores."""
    import os
    import sys

    ray = sys.modules.get("ray")  # not imported: not started either
    if os.environ.get("RAY_ADDRESS") or (ray is not None and ray.is_initialized()):
        return None
    wanted = s.max_workers * s.cpus_per_worker
    cores = os.cpu_count() or 1
    if wanted <= cores:
        return None
    # the share of a core that lets every worker of the largest size have its own part
    share = max(0.25, math.floor(cores / s.max_workers * 4) / 4)
    return (
        f"scaling.num_workers={s.max_workers} × scaling.cpus_per_worker={s.cpus_per_worker:g} "
        f"reserve {wanted:g} CPUs on this machine's {cores} cores: the local Ray is sized to "
        "hold them, so the workers share cores (oversubscribed: slower steps, the same "
        f"results). Fix: scaling.cpus_per_worker={share:g} ({s.max_workers} workers on "
        f"{cores} cores), fewer workers, or a cluster (RAY_ADDRESS)"
    )


def _notes(spec: RunSpec) -> list[str]:
    cfg, split = spec.cfg, spec.reference
    notes = [elastic_summary(cfg, spec.splits)] if cfg.scaling.elastic else []
    if cfg.batch.auto_micro_batch:
        notes.append(
            f"micro-batch auto: the workers search the largest divisor of {split.micro_batch_size} "
            "(one worker's share) that fits the memory budget; the line above shows that upper "
            "bound, the chosen size is printed when training starts"
        )
    return notes


def batchnorm_layers(model) -> list[str]:
    from torch import nn

    return [
        n or "<root>"
        for n, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]


# ----------------------------------------------------------------------------- the run
def locate(run: RunConfig, resume: bool, terms: ResumeTerms) -> RunLocation:
    """The run's location (`runs.locate_run`: without run.name, a resume takes the latest run
    of the same job), and on a resume the check that its latest checkpoint may be continued by
    this run (`terms`: `RunSpec.resume_terms`)."""
    loc = locate_run(run, resume, terms.identity)
    if resume:
        check_resume(terms, loc)
    return loc


def check_resume(terms: ResumeTerms, loc: RunLocation) -> None:
    """The latest checkpoint's identity against this config's: another seed, data, split,
    order, model, strategy or (for a run that keeps it) global batch would re-split and
    re-order the data under the saved sample position, or fail inside the workers."""
    import tempfile

    from rayacc.checkpoint.reader import CheckpointError, malformed_message
    from rayacc.checkpoint.storage import open_storage
    from rayacc.driver.ray_record import reconcile_record

    # Ray Train refuses to start on a record naming a folder that is gone: the two agree first
    loc.notes += reconcile_record(open_storage(loc.storage).child(loc.name))
    checkpoints = loc.checkpoints
    if loc.local:
        # what the workers will do: the newest checkpoint that reads (whole, every digest as
        # listed, plain data), so that one they would refuse is said here, before Ray starts
        with tempfile.TemporaryDirectory(prefix="rayacc-resume-") as scratch:
            found = checkpoints.load_latest(Path(scratch))
        meta = found[2][2] if found is not None else {}
    else:
        latest = checkpoints.latest()  # the workers check every digest when they load it
        meta = latest.meta() if latest is not None else {}
    loc.notes += [f"passed over {note}" for note in checkpoints.skipped]
    loc.resume_step = meta.get("optimizer_step")
    if not meta and checkpoints.skipped:
        raise CheckpointError(
            f"--resume of run {loc.name!r}: none of its checkpoints can be used:\n  "
            + "\n  ".join(checkpoints.skipped[:5])
            + "\nFix: restore the run's folder from a copy, or start a new run (drop --resume)"
        )
    saved = meta.get("identity")
    if saved is None:
        return  # nothing saved yet (or a checkpoint from before identities)
    if not isinstance(saved, dict):
        raise CheckpointError(malformed_message(f"{loc.name}/meta.json", "identity"))
    now = terms.identity
    diffs = [
        f"{key}: the run has {saved.get(key)!r}, this config {now.get(key)!r}"
        for key in sorted(set(saved) | set(now))
        if saved.get(key) != now.get(key)
    ]
    diffs += _global_batch_change(terms, meta)
    diffs += _resize_issues(terms, meta)
    if diffs:
        raise DataError(
            f"--resume of run {loc.name!r}: the checkpoint at step {meta.get('optimizer_step')} "
            "was trained on other data, another model or another global batch, and resuming "
            "would re-split and re-order the data under its saved position:\n  "
            + "\n  ".join(diffs)
            + "\nFix: resume with the run's values of these fields (and its data), or start a "
            "new run (drop --resume, or another run.name)"
        )


def _resize_issues(terms: ResumeTerms, meta: dict[str, Any]) -> list[str]:
    """What the checkpoint's state format says of a resume at this run's worker count
    (DeepSpeed's moves to another count with Adam's state only)."""
    fmt = state_format_named(meta.get("state_format"))
    saved = meta.get("num_workers")
    if fmt is None or type(saved) is not int or saved == terms.workers:
        return []
    return fmt.resize_issues(saved, terms.workers, terms.optimizer)


def _global_batch_change(terms: ResumeTerms, meta: dict[str, Any]) -> list[str]:
    """The global batch a run that keeps it resolves to now, against the checkpoint's (a run
    that gives micro × accumulation changes it with the worker count)."""
    saved = meta.get("global_batch_size")
    now = terms.global_batch_size
    if now is None or saved is None or saved == now:
        return []
    return [
        f"batch.global_batch_size: the run has {saved}, this config resolves to {now} "
        f"(set batch.global_batch_size: {saved})"
    ]


# ----------------------------------------------------------------------------- the cluster
def check_cluster(scaling: ScalingConfig, mesh: Mesh | None = None) -> None:
    """A worker group the cluster can never hold is a user error (Ray Train would wait
    forever), as is a tensor-parallel group no node holds; on a cluster that may grow (one
    rayacc did not start), a warning."""
    import os
    import sys

    import ray

    may_grow = bool(os.environ.get("RAY_ADDRESS"))
    warning = check_resources(scaling, ray.nodes(), may_grow, mesh)
    if warning:
        print(f"rayacc: warning: {warning}; waiting for the cluster to grow", file=sys.stderr)


class ResourceError(ValueError):
    """The request can never be met by the cluster as it is: names what is missing and the fix."""


def workers_that_fit(nodes: list[dict[str, float]], need: dict[str, float]) -> int:
    """How many workers the nodes' total resources hold (each worker on one node)."""
    fit = 0
    for resources in nodes:
        fit += min(
            (math.floor(resources.get(k, 0.0) / v + 1e-9) if v > 0 else 10**9)
            for k, v in need.items()
        )
    return fit


def check_resources(
    scaling: ScalingConfig, nodes: list[dict[str, Any]], may_grow: bool, mesh: Mesh | None = None
) -> str | None:
    """Raises ResourceError when the alive `nodes` (as `ray.nodes()` lists them) can never hold
    `scaling.num_workers`' minimum, or no node holds a tensor-parallel group of the `mesh`'s
    workers; with `may_grow` (a cluster that may add nodes) returns the same finding as a
    warning instead. None when the group fits."""
    tensor_parallel = (mesh or Mesh()).tensor
    need = scaling.worker_needs()
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", True)]
    placement = scaling.placement_strategy
    per_node = [workers_that_fit([r], need) for r in alive]
    largest = max(per_node, default=0)
    if tensor_parallel > largest > 0:
        # its collectives run every layer, forward and backward: one node's links
        text = (
            f"{mesh.setting('tensor')}: a tensor-parallel group shares a node, "
            f"and the cluster's largest node holds {largest} worker(s) of "
            f"{{{', '.join(f'{k}: {v:g}' for k, v in need.items())}}}. Fix: set "
            f"{Mesh.key('tensor')} to at most {largest}, or use nodes that hold "
            f"{tensor_parallel} workers each"
        )
        if may_grow:
            return text
        raise ResourceError(text)
    if placement == "STRICT_SPREAD":  # one worker a node
        fit, held = sum(min(n, 1) for n in per_node), "node(s) that can each hold a worker"
    elif placement == "STRICT_PACK":  # every worker on one node
        fit, held = max(per_node, default=0), "worker(s) on their largest node"
    else:
        fit, held = sum(per_node), "worker(s)"
    wanted = scaling.min_workers
    if fit >= wanted:
        return None
    offered = sorted({k for r in alive for k in r if not k.startswith(("node:", "accelerator_"))})
    missing = [k for k in need if not any(r.get(k, 0) >= need[k] for r in alive)]
    asked = ", ".join(f"{k}: {v:g}" for k, v in need.items())
    text = (
        f"the worker group needs {wanted} worker(s) of {{{asked}}} placed "
        f"{placement} (scaling.num_workers, scaling.cpus_per_worker, scaling.use_gpu, "
        f"scaling.extra_resources, scaling.placement_strategy); the cluster's "
        f"{len(alive)} node(s) hold {fit} {held}"
        + (f", and no node offers enough {', '.join(missing)}" if missing else "")
        + f" (resources offered: {', '.join(offered)}). Fix: "
        + _fix(scaling, missing, sum(per_node) >= wanted)
    )
    if may_grow:
        return text
    raise ResourceError(text)


def _fix(scaling: ScalingConfig, missing: list[str], placement_only: bool) -> str:
    if placement_only:  # enough in all, not where the placement strategy needs it
        if scaling.placement_strategy == "STRICT_SPREAD":
            return "set scaling.placement_strategy=SPREAD, or add nodes (one per worker)"
        return "set scaling.placement_strategy=PACK, or use a node large enough for the group"
    if "GPU" in missing:
        return "set scaling.use_gpu=false, or run on a cluster with GPU nodes"
    if any(k in scaling.extra_resources for k in missing):
        return (
            "remove scaling.extra_resources, or start nodes that offer them (cluster/local.sh "
            "gives each node a worker_slot) and set RAY_ADDRESS"
        )
    return "lower scaling.num_workers or scaling.cpus_per_worker, or add nodes"
