"""What a run is (`RunSpec`): derived once on the driver from the config and the data
(`derive_run`) and handed to the workers typed, with the settings a rank acts on
(`WorkerSettings`); the workers derive none of it again."""

from __future__ import annotations

from dataclasses import dataclass

from rayacc.config import TrainConfig
from rayacc.config.batch_split import BatchSplit, BatchSplitError
from rayacc.data.order import DataOrder, EpochLayout
from rayacc.data.sources import DatasetInfo, RowGroups
from rayacc.engine.parallel import strategy_class
from rayacc.optim import optimizer_slots
from rayacc.rank.build import strategy_for
from rayacc.run.quantities import (
    EpochWindows,
    Phase,
    RunLength,
    batch_phases,
    data_order,
    epoch_layout,
    lr_explanation,
    phase_sizes,
    remaining_epochs,
    run_effective_lr,
    run_identity,
    schedule_length,
    tokens_per_sample,
    total_optimizer_steps,
    windows_left,
    worker_splits,
)

__all__ = ["ResumeTerms", "RunSpec", "WorkerSettings", "derive_run"]


@dataclass(frozen=True)
class WorkerSettings:
    """The settings a rank acts on, read from the config once on the driver: each is the config
    field of its name (the section in its docstring) or, where said, derived from fields."""

    seed: int
    strategy: str
    """train."""
    cpus_per_worker: float
    """scaling: one intra-op thread per reserved CPU."""
    precision: str
    allow_tf32: bool
    peak_tflops: float | None
    """train: the device's and precision's peak (None: from the device's name)."""
    val_every_steps: int | None
    checkpoint_every_steps: int | None
    checkpoint_mode: str
    checkpoint_on_preemption: bool
    """train."""
    auto_micro_batch: bool
    memory_budget: float
    memory_budget_mb: float | None
    balance: bool
    """batch (`balance: auto`)."""
    on_resize: str
    """scaling."""
    system_metrics: bool
    """tracking."""
    read_in_process: bool
    """Derived: the data is small enough (`data.in_process_read_max_mb`) for each rank to read
    its rows itself rather than through Ray Data."""
    optimizer_slots: int
    """Derived: values the optimizer keeps per parameter (`optim.name`, `optim.momentum`)."""
    strategy_user: dict | None = None
    """The strategy's own file the config names (DeepSpeed's `deepspeed.config`), as the
    driver read it (the workers may not see the file)."""

    @classmethod
    def of(cls, cfg: TrainConfig, info: DatasetInfo) -> WorkerSettings:
        t, b = cfg.train, cfg.batch
        return cls(
            seed=cfg.seed,
            strategy=t.strategy,
            cpus_per_worker=cfg.scaling.cpus_per_worker,
            precision=t.precision,
            allow_tf32=t.allow_tf32,
            peak_tflops=t.peak_tflops,
            val_every_steps=t.val_every_steps,
            checkpoint_every_steps=t.checkpoint_every_steps,
            checkpoint_mode=t.checkpoint_mode,
            checkpoint_on_preemption=t.checkpoint_on_preemption,
            auto_micro_batch=b.auto_micro_batch,
            memory_budget=b.memory_budget,
            memory_budget_mb=b.memory_budget_mb,
            balance=b.balance == "auto",
            on_resize=cfg.scaling.on_resize,
            system_metrics=cfg.tracking.system_metrics,
            read_in_process=0 < info.data_bytes <= cfg.data.in_process_read_max_mb * 2**20,
            optimizer_slots=optimizer_slots(cfg.optim),
            strategy_user=strategy_class(cfg.train.strategy).read_user_config(cfg),
        )


@dataclass(frozen=True)
class RunSpec:
    """What a run is, derived once on the driver from the validated config and the data's
    description (`derive_run`). The workers receive it whole and derive none of it again;
    what only a worker group can know (the micro-batch an auto search finds, where a resumed
    run stands) is worked out there from these."""

    cfg: TrainConfig
    info: DatasetInfo
    groups: RowGroups
    """The source's Parquet row groups (the units data is read in)."""
    order: DataOrder
    """The training/validation split and each epoch's order of rows."""
    reference: BatchSplit
    """The batch split at the most workers: the LR schedule is laid out for it."""
    splits: dict[int, BatchSplit | BatchSplitError]
    """The batch split at each worker count the run may run at, or why it cannot run there."""
    lrs: dict[int, float]
    """The effective LR at each worker count it may run at (`optim.lr_scaling`)."""
    length: RunLength
    """What bounds the run's length (steps, epochs, the last window's cut)."""
    layout: EpochLayout
    """An epoch at the reference split."""
    schedule_length: float
    """The LR schedule's length, in steps of the reference global batch (`schedule_length`)."""
    total_steps: int
    identity: dict[str, object]
    """What a checkpoint of the run must match to be resumed (`run_identity`)."""
    worker: WorkerSettings
    """What a rank acts on besides the quantities above."""
    description: dict[str, object]
    """What every checkpoint describes itself with: the config and the dataset (JSON)."""
    record_files: dict[str, str]
    """The strategy's files for the run's record (DeepSpeed: the merged config), as the
    strategy took them from the job and the driver's read of the user's file."""
    phases: tuple[Phase, ...] = ()
    """The phases of `batch.schedule`: phase k ≥ 1 is `phases[k - 1]`; phase 0 the
    configured global batch (`splits`, `lrs`). Under `auto`, every size it may run, phase k
    the one 2^k times the configured (k < 0 below it)."""

    @property
    def lr_explanation(self) -> str:
        """How the effective LR follows from `optim.*` and the reference global batch."""
        return lr_explanation(self.cfg, self.reference)

    @property
    def resume_terms(self) -> ResumeTerms:
        return ResumeTerms.of(self.cfg, self.identity, self.reference)

    @property
    def effective_lr(self) -> float:
        return self.lr_at(self.cfg.scaling.max_workers)  # the reference split's group

    @property
    def auto(self) -> bool:
        """`batch.schedule: auto`: the phase moves with the gradient noise scale."""
        return self.cfg.batch.schedule == "auto"

    def phase_at(self, samples: int) -> int:
        """The phase of a listed `batch.schedule` a window starting at sample `samples` runs in."""
        return sum(1 for p in self.phases if p.from_samples <= samples)

    def phase_of(self, state) -> int:
        """The phase a window from `state` (a TrainState) runs in: `auto`'s as the run moved
        it (kept by the checkpoints), a listed schedule's by the samples trained."""
        return state.batch_phase if self.auto else self.phase_at(state.samples_seen)

    def has_phase(self, phase: int) -> bool:
        """Whether the run has `phase` (`auto` moves only within its sizes)."""
        return 0 <= self._index(phase) < len(self.phases) if self.auto else phase == 0

    def _index(self, phase: int) -> int:
        """Where `auto`'s phase stands in `phases` (ascending sizes, the configured among them)."""
        sizes = [p.global_batch_size for p in self.phases]
        return sizes.index(self.cfg.batch.global_batch_size) + phase

    def _table(self, phase: int) -> tuple[dict, dict]:
        """The splits and LRs by worker count of `phase`."""
        if self.auto:
            p = self.phases[self._index(phase)]
            return p.splits, p.lrs
        return (
            (self.phases[phase - 1].splits, self.phases[phase - 1].lrs)
            if phase
            else (self.splits, self.lrs)
        )

    def split_at(self, workers: int, phase: int = 0) -> BatchSplit:
        """The batch split of a group of `workers` (in `phase`); BatchSplitError where it
        cannot run."""
        split = self._table(phase)[0].get(workers)
        if split is None:
            raise BatchSplitError(
                "scaling.num_workers",
                f"a group of {workers} workers is outside the run's sizes {sorted(self.splits)}",
                "run the job with a scaling.num_workers that includes it",
            )
        if isinstance(split, BatchSplitError):
            raise split
        return split

    def lr_at(self, workers: int, phase: int = 0) -> float:
        self.split_at(workers, phase)
        return self._table(phase)[1][workers]

    def layout_at(self, split: BatchSplit) -> EpochLayout:
        """An epoch of the run at `split`."""
        return epoch_layout(self.length, self.order.num_train_rows, split)

    def epochs_from(self, state, split: BatchSplit, rank: int) -> list[EpochWindows]:
        """The windows rank `rank` runs at `split` from `state` on (`remaining_epochs`), up to
        the window that reaches the next phase of `batch.schedule`."""
        phase = self.phase_of(state)
        listed = not self.auto and phase < len(self.phases)
        until = self.phases[phase].from_samples if listed else None
        rows = self.order.num_train_rows
        return remaining_epochs(self.length, rows, state, split, rank, until_samples=until)

    def steps_left(self, state, ranks: int) -> int | None:
        """The steps from `state` to the end over `ranks` data-parallel ranks where a
        `batch.schedule` changes the global batch (None without one: each group's epochs
        say)."""
        if not self.phases or self.auto:
            return None
        sizes = phase_sizes(self.reference, self.phases)
        return windows_left(self.length, self.order.num_train_rows, state, sizes, ranks)[0]


@dataclass(frozen=True)
class ResumeTerms:
    """What a checkpoint must agree with for this run to continue it (`prelaunch.check_resume`)."""

    identity: dict[str, object]
    """`RunSpec.identity`: the data, model, seed, strategy the checkpoint must share."""
    global_batch_size: int | None
    """The global batch the checkpoint must have, or None where a resize may change it."""
    workers: int
    """The size of the first worker group (a state format may not move to it)."""
    optimizer: str

    @classmethod
    def of(
        cls, cfg: TrainConfig, identity: dict[str, object], reference: BatchSplit | None = None
    ) -> ResumeTerms:
        s = cfg.scaling
        # a batch.schedule's global batch is the phase's at the checkpoint's sample
        keeps = (not s.elastic or s.on_resize == "keep_global_batch") and not cfg.batch.schedule
        reference = reference if reference is not None else cfg.batch_split()
        return cls(
            identity,
            reference.global_batch_size if keeps else None,
            s.min_workers,
            cfg.optim.name,
        )


def derive_run(
    cfg: TrainConfig,
    info: DatasetInfo,
    groups: RowGroups,
    order: DataOrder | None = None,
    reference: BatchSplit | None = None,
) -> RunSpec:
    """The run's :class:`RunSpec` (`order`, `reference`: its data order and its split at the
    most workers, where the caller has checked them already). Raises BatchSplitError when the
    config's own batch cannot run (the worker counts of an elastic run that cannot are kept as
    their errors)."""
    if cfg.model.name == "hf" and not isinstance(cfg.model.hf.config, dict):
        # read here, on the driver, once: the workers (and a checkpoint's description) carry
        # the config itself, not a path their node may not have
        from rayacc.models.hf import resolve_hf_config

        hf = cfg.model.hf.model_copy(
            update={"config": resolve_hf_config(cfg.model.hf.config, cfg.model.hf.weights)}
        )
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"hf": hf})})
    reference = reference if reference is not None else cfg.batch_split()
    splits = worker_splits(cfg)
    lrs = {
        w: run_effective_lr(cfg, split)
        for w, split in splits.items()
        if isinstance(split, BatchSplit)
    }
    order = order if order is not None else data_order(cfg, info, groups)
    worker = WorkerSettings.of(cfg, info)
    # the strategy's settings (DeepSpeed: the user's file) against the job, before anything
    # starts (DeepSpeedConfigError)
    strategy = strategy_for(cfg, reference, worker.strategy_user)
    length = RunLength.of(cfg)
    layout = epoch_layout(length, order.num_train_rows, reference)
    total, schedule = total_optimizer_steps(length, layout), schedule_length(length, layout)
    phases = batch_phases(cfg, tokens_per_sample(info))
    if phases and cfg.batch.schedule != "auto":
        # the steps and the LR schedule's length as the phases make them
        from rayacc.engine.train_state import TrainState

        sizes = phase_sizes(reference, phases)
        ranks = reference.data_parallel
        total, last = windows_left(length, order.num_train_rows, TrainState(), sizes, ranks)
        schedule = (last or 0) / reference.global_batch_size + 1
    return RunSpec(
        cfg=cfg,
        info=info,
        groups=groups,
        order=order,
        reference=reference,
        splits=splits,
        lrs=lrs,
        layout=layout,
        length=length,
        schedule_length=schedule,
        total_steps=total,
        identity=run_identity(cfg, info),
        worker=worker,
        description={"config": cfg.model_dump(mode="json"), "dataset": info.to_dict()},
        record_files=strategy.record_files(),
        phases=phases,
    )
