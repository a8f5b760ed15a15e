"""What a run tells its observers: typed events, and per-step records.

Rank 0 of the worker group sends them to the driver in order; the driver hands each to every
observer (the console, MLflow, the run's history). A step record is a plain mapping of metric
name → value with `step` (the optimizer step, 1-based); everything else is an event below.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rayacc.observe.ranks import Straggler

__all__ = [
    "CheckpointPassedOver",
    "CheckpointWaited",
    "Checkpointed",
    "Event",
    "GroupStarting",
    "MicroBatchChanged",
    "PreemptionNotice",
    "ReclaimStandby",
    "Resized",
    "RunObserver",
    "RunStarted",
    "ScheduleChanged",
    "Straggler",
]


@dataclass(frozen=True)
class RunStarted:
    """A worker group started (the first time, or again after a failure or a resize)."""

    step: int
    """Optimizer steps already done (0 on a fresh run)."""
    total_steps: int
    resumed_from: int | None
    """The checkpoint's step when the group restored one."""
    layout: str
    """How the epoch splits into windows."""
    split: dict[str, int]
    """The batch split this group runs (BatchSplit fields)."""
    effective_lr: float
    restore_s: float = 0.0
    """How long loading the checkpoint took (rank 0; none restored: 0)."""
    entered_at: float | None = None
    """When rank 0's train function began (time.time()): the group's start ends there."""
    nodes: tuple[str, ...] = ()
    """Every rank's node, in rank order (a straggler is named with its node)."""
    node_figures: tuple[str, ...] = ()
    """Names of the node figures (MLflow's system metrics) that follow `ranks.FIELDS` in
    every rank's report."""
    mesh: str = ""
    """The strategy's mesh where this group decided it (`Strategy.describe_mesh`: HSDP's)."""
    places: tuple[str, ...] = ()
    """Every rank's place on the mesh (`dp 1 · tp 0`), in rank order, where the ranks are
    more than their data-parallel rank (tensor parallelism); () elsewhere."""
    process_started_at: float | None = None
    """When rank 0's worker process was created (time.time()): the group's start begins no
    earlier."""
    announced_at: float | None = None
    """When rank 0 sent this (time.time()): the driver reads it up to the outbox's half second
    later, often with the first steps, so the time before it ends here, not at the read."""

    def describe(self, before: RunStarted | None = None) -> str | None:
        """The console's line; `before`: the fit's previous group, if any. A group that
        follows another without a checkpoint to start from redoes every step before it,
        which is said (with the change of size that caused it, on an elastic run)."""
        lines = [self.mesh] if self.mesh else []
        if self.resumed_from is not None:
            lines.append(f"resumed from the checkpoint at step {self.resumed_from}")
        elif before is not None:
            was, now = before.split.get("num_workers"), self.split.get("num_workers")
            lines.append(
                "restarted from the beginning (no checkpoint yet)"
                + (f": workers {was} → {now}" if was != now else "")
            )
        return "\n  ".join(lines) or None


@dataclass(frozen=True)
class Resized:
    """An elastic run restarted at another worker count."""

    step: int
    policy: str
    old_workers: int
    new_workers: int
    old_grad_accum_steps: int | None
    new_grad_accum_steps: int
    old_global_batch_size: int
    new_global_batch_size: int
    effective_lr: float
    new_micro_batch_size: int
    new_shares: tuple[int, ...] = ()
    """Rows per rank where the new size does not divide the global batch (uneven shares)."""

    @property
    def _shares(self) -> str:
        return f", shares {'+'.join(map(str, self.new_shares))}" if self.new_shares else ""

    def describe(self) -> str:
        """The line kept in the run's `rayacc.resizes` tag: the params the group from this
        step on ran with (MLflow's params are written once, for the first group)."""
        return (
            f"step {self.step}: workers {self.old_workers}→{self.new_workers}, accum "
            f"{self.old_grad_accum_steps}→{self.new_grad_accum_steps}, global "
            f"{self.old_global_batch_size}→{self.new_global_batch_size} (micro "
            f"{self.new_micro_batch_size}{self._shares}, effective LR {self.effective_lr:.6g})"
        )

    def console_line(self) -> str:
        return (
            f"resize at step {self.step}: workers {self.old_workers} → {self.new_workers}, "
            f"accumulation {self.old_grad_accum_steps} → {self.new_grad_accum_steps}, global "
            f"batch {self.old_global_batch_size} → {self.new_global_batch_size}"
            f"{self._shares.replace('+', ' + ')}, effective LR {self.effective_lr:.6g}"
        )


@dataclass(frozen=True)
class BatchPhaseChanged:
    """`batch.schedule` moved the run to its next global batch, at the first window starting at
    or past the phase's sample."""

    step: int
    samples: int
    """Samples trained when the phase starts."""
    old_global_batch_size: int
    new_global_batch_size: int
    old_grad_accum_steps: int
    new_grad_accum_steps: int
    effective_lr: float
    """The phase's LR by `optim.lr_scaling` (reached over the re-warmup of a resize)."""
    noise_scale: float | None = None
    """`batch.schedule: auto`: the smoothed gradient noise scale it moved by."""
    total_steps: int | None = None
    """`batch.schedule: auto`: the run's last step at its new global batch."""

    @property
    def _why(self) -> str:
        if self.noise_scale is None:
            return ""
        return f" (auto: gradient noise scale {self.noise_scale:.4g})"

    def describe(self) -> str:
        """The line kept in the run's `rayacc.batch_phases` tag."""
        return (
            f"step {self.step}: from sample {self.samples}, global {self.old_global_batch_size}→"
            f"{self.new_global_batch_size}, accum {self.old_grad_accum_steps}→"
            f"{self.new_grad_accum_steps}, effective LR {self.effective_lr:.6g}{self._why}"
        )

    def console_line(self) -> str:
        return (
            f"batch schedule at step {self.step} (sample {self.samples}): global batch "
            f"{self.old_global_batch_size} → {self.new_global_batch_size}, accumulation "
            f"{self.old_grad_accum_steps} → {self.new_grad_accum_steps}, effective LR "
            f"{self.effective_lr:.6g}{self._why}"
            + (f"; {self.total_steps} optimizer steps in all" if self.total_steps else "")
        )


@dataclass(frozen=True)
class SharesChanged:
    """`batch.balance: auto` moved rows of a window between ranks (the global batch kept)."""

    step: int
    old: tuple[int, ...]
    new: tuple[int, ...]
    """Rows of a full window per data-parallel rank, before and from the next step on."""
    why: str

    def describe(self) -> str:
        """The line kept in the run's `rayacc.shares` tag."""
        return f"step {self.step}: {'+'.join(map(str, self.old))}→{'+'.join(map(str, self.new))}"

    def console_line(self) -> str:
        return (
            f"shares at step {self.step}: {' + '.join(map(str, self.old))} → "
            f"{' + '.join(map(str, self.new))} rows ({self.why})"
        )


@dataclass(frozen=True)
class MicroBatchChanged:
    """The micro-batch (and so the accumulation) changed: chosen by the auto search, or cut by
    an out-of-memory retry. The global batch stays."""

    step: int
    """Optimizer steps done before the change; it applies from step + 1."""
    micro_batch_size: int
    grad_accum_steps: int
    reason: str
    """`auto search` or `out of memory`."""
    budget_mb: float | None = None
    trials: tuple[tuple[int, bool], ...] = field(default_factory=tuple)
    """Sizes the search tried, each with whether it fitted."""
    out_of_memory: tuple[int, ...] = ()
    """Sizes the search tried that ran out of device memory."""

    def describe(self) -> str:
        """The line kept in the run's `rayacc.micro_batch_events` tag."""
        return (
            f"step {self.step}: micro {self.micro_batch_size} × accum {self.grad_accum_steps} "
            f"({self.reason})"
        )

    def console_line(self) -> str:
        tried = ", ".join(f"{m}{'✓' if ok else '✗'}" for m, ok in self.trials)
        oom = ", ".join(map(str, self.out_of_memory))
        return (
            f"micro-batch {self.micro_batch_size} × accumulation {self.grad_accum_steps} from "
            f"step {self.step + 1} ({self.reason}{'; tried ' + tried if tried else ''}"
            f"{'; out of memory at ' + oom if oom else ''})"
        )


@dataclass(frozen=True)
class ScheduleChanged:
    """A resume changed the run's length (`train.max_steps`, `train.epochs`): the LR goes on
    from where it was, and the rest of its decay is re-planned over the new length."""

    step: int
    old_length: float | None
    """The schedule's length in steps of the reference global batch, before and after."""
    new_length: float | None
    lr: float
    """The LR the next step runs at (the one the checkpoint's step ran at)."""
    reference_batch: int = 0
    """The global batch the lengths count in (0: unknown)."""

    def describe(self) -> str:
        """The line kept in the run's `rayacc.schedule_changes` tag."""
        old, new = self._length(self.old_length), self._length(self.new_length)
        return f"step {self.step}: length {old}→{new}, LR {self.lr:.6g} decays from there"

    def console_line(self) -> str:
        return (
            f"schedule re-planned at step {self.step}: the run's length changed from "
            f"{self._length(self.old_length)} to {self._length(self.new_length)}; the LR goes "
            f"on from {self.lr:.6g} (no warmup again) and decays to the end of the new length"
        )

    def _length(self, length: float | None) -> str:
        """Whole steps; in samples where short windows make it a fraction of a step."""
        if length is None:
            return "open-ended"
        if length == round(length) or not self.reference_batch:
            return f"{round(length)} steps"
        return f"{round(length * self.reference_batch):,} samples"


@dataclass(frozen=True)
class Checkpointed:
    """The ranks wrote a checkpoint (the time it took counts against the run's goodput)."""

    step: int
    seconds: float
    reason: str
    """`periodic`, `last` (the run's end), `preemption notice` or `before the reclaim`."""
    waited_s: float = 0.0
    """Of `seconds`, the wait for the checkpoint before, still being written (asynchronous
    checkpoints: at most one is in flight)."""

    def console_line(self) -> None:
        """Checkpoints are not announced one by one (the summary says what they cost)."""
        return None


@dataclass(frozen=True)
class CheckpointPassedOver:
    """A restore chose a checkpoint that did not load and went on from the one before it (or
    from the beginning); the folder is marked, so no later group chooses it again."""

    note: str
    """Which checkpoint, and every rank's reason."""
    resumed_from: int | None
    """The step of the checkpoint the group loaded instead (None: none)."""

    def describe(self) -> str:
        """The line kept in the run's `rayacc.passed_over` tag."""
        return f"{self.note} → {self._instead()}"

    def console_line(self) -> str:
        return f"checkpoint passed over: {self.note}; the group goes on {self._instead()}"

    def _instead(self) -> str:
        if self.resumed_from is None:
            return "from the beginning"
        return f"from the checkpoint at step {self.resumed_from}"


@dataclass(frozen=True)
class CheckpointWaited:
    """Training waited for the checkpoint in flight to be in storage without writing one after
    it (a reclaim's notice wants the newest checkpoint kept before anything else)."""

    step: int
    seconds: float

    def console_line(self) -> None:
        return None


@dataclass(frozen=True)
class PreemptionNotice:
    """A node hosting ranks of the group is being reclaimed (a spot or preemptible instance
    Ray drains for preemption), and what the ranks did at the window they learned of it."""

    step: int
    nodes: tuple[str, ...]
    ranks: tuple[int, ...]
    seconds_left: float
    """From the window's end to the reclaim deadline (Ray's 120 s when the drain gave none)."""
    deadline_given: bool
    checkpoint_s: float | None
    """The just-in-time checkpoint's time; None when none was written."""
    checkpoint_step: int | None
    """The checkpoint a restart resumes from as things stand."""
    too_short: bool = False
    """The notice left less time than a checkpoint takes: none was written."""
    deadline_at: float | None = None
    """The reclaim's deadline (time.time())."""

    def describe(self) -> str:
        """The entry kept in the run's `rayacc.preemptions` tag."""
        nodes = ",".join(n[:12] for n in self.nodes)
        ranks = ",".join(map(str, self.ranks))
        left = f"deadline in {self.seconds_left:.1f} s"
        if not self.deadline_given:
            left += " (none given)"
        if self.too_short:
            done = f"too short for a checkpoint: resumes from step {self.checkpoint_step}"
        elif self.checkpoint_s is None:
            done = f"checkpoint of step {self.step} already written"
        else:
            spare = self.seconds_left - self.checkpoint_s
            done = f"checkpoint {self.checkpoint_s:.1f} s, {spare:.1f} s to spare"
        return f"step {self.step}: node {nodes} (ranks {ranks}), {left}, {done}"

    def console_line(self) -> str:
        nodes = ", ".join(n[:12] for n in self.nodes)
        ranks = ", ".join(map(str, self.ranks))
        given = "" if self.deadline_given else " (the drain gave no deadline: Ray's default)"
        head = (
            f"preemption notice at step {self.step}: node {nodes} (ranks {ranks}) is reclaimed "
            f"in {self.seconds_left:.0f} s{given}"
        )
        if self.too_short:
            fallback = (
                f"the checkpoint of step {self.checkpoint_step}"
                if self.checkpoint_step
                else "the start of the run (no checkpoint yet)"
            )
            return (
                f"{head}; too short for a checkpoint (one takes longer than that): none written, "
                f"the restart resumes from {fallback}"
            )
        if self.checkpoint_s is None:
            return f"{head}; step {self.step} is checkpointed already; training goes on"
        return (
            f"{head}; checkpoint of step {self.step} written in {self.checkpoint_s:.1f} s; "
            "training goes on until just before the deadline"
        )


@dataclass(frozen=True)
class ReclaimStandby:
    """The last checkpoint before a reclaim's deadline is written: the ranks wait there for
    Ray Train to restart the group without the reclaimed node, so no step is recomputed."""

    step: int
    seconds_left: float
    """From the checkpoint's end to the deadline."""
    kept_until_deadline: str | None = None
    """Why the group could not end at once and waits for the deadline; None: it ends now."""
    deadline_at: float | None = None
    """When the group ends (time.time()): the drain's deadline as it now stands, brought
    forward when the group ends at once."""
    sizing_note: str | None = None
    """Why Ray's elastic sizing may still count the reclaimed node for a while; None: it was
    told."""

    def describe(self) -> str:
        return f"step {self.step}: last checkpoint, {self.seconds_left:.1f} s before the deadline"

    def console_line(self) -> str:
        head = (
            f"last checkpoint before the reclaim at step {self.step}, {self.seconds_left:.0f} s "
            "before the deadline; "
        )
        sizing = f" ({self.sizing_note})" if self.sizing_note else ""
        if self.kept_until_deadline is None:
            return head + "the group ends now and restarts without the reclaimed node" + sizing
        return (
            head
            + (
                f"the workers wait for the restart without the reclaimed node at the deadline "
                f"(the group could not end at once: {self.kept_until_deadline})"
            )
            + sizing
        )


@dataclass(frozen=True)
class GroupStarting:
    """A worker group's start spends long on something before its first step (the strategy's
    engine, say): said as it begins, so a quiet console is not taken for a hang."""

    what: str

    def console_line(self) -> str:
        return self.what


Event = (
    GroupStarting
    | RunStarted
    | Resized
    | BatchPhaseChanged
    | SharesChanged
    | MicroBatchChanged
    | ScheduleChanged
    | Checkpointed
    | CheckpointPassedOver
    | CheckpointWaited
    | PreemptionNotice
    | ReclaimStandby
    | Straggler
)


class RunObserver:
    """Sees a run's events and step records in order, on the driver. Subclasses override what
    they use; the console and MLflow are two such observers."""

    def on_event(self, event: Event) -> None:
        """An event (see `Event`)."""

    def on_step(self, record: dict[str, Any]) -> None:
        """The metrics of one optimizer step (`step` and metric name → value)."""
