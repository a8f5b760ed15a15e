"""The accumulation step: one optimizer step over a window of micro-batches.

The one normalisation rule (docs/design.md): the gradient the optimizer sees is
``∇ sum(item losses of the window on all ranks) / N_window``, N_window the loss items of the whole
window on all ranks. Micro-steps back-propagate item-loss sums; the gradient all-reduce sums them
over the ranks (the engine's comm hook; DDP's default one averages, and then the factor carries
world_size); once N_window arrives (it travels with the gradients, see `CommCounter`) the
gradients are multiplied by 1 / N_window, once. So the step follows ∇(mean item loss over the
global batch) whatever the workers, micro-batch size, accumulation or padding, and for a short
last window too (it has its own N_window). fp16 applies the same factor to the loss before
backward instead, as GradScaler expects gradients of that size.
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from rayacc.engine.collectives import all_reduce
from rayacc.engine.figures import RankFigures
from rayacc.engine.losses import Batch, ItemCounter, LossFn, count_rows, split_rows, summed
from rayacc.engine.noise import NoiseProbe
from rayacc.engine.parallel import Strategy, strategy_of
from rayacc.engine.precision import PRECISIONS, autocast
from rayacc.engine.result import StepResult

__all__ = ["PRECISIONS", "AccumulationStep", "MicroStepMismatchError"]


class MicroStepMismatchError(RuntimeError):
    """Ranks were given different numbers of micro-batches for one window. Raised on every rank
    at once (they all see the same all-reduced counts), instead of the silent DDP hang that one
    extra backward on a single rank would cause."""


class AccumulationStep:
    """Runs windows of micro-batches through `model` and steps `optimizer` once per window.

    Order per window: micro-steps (forward + backward of item-loss sums, under `no_sync` except
    the last) → the window's statistics (loss sum, items, samples, micro-step parity) summed
    over the ranks with the last micro-step's gradient all-reduce → parity and finiteness
    checks → unscale (fp16) → × 1 / N_window folded into clipping's multiply → step →
    scheduler. fp16 all-reduces the counts before the first backward instead and scales the
    loss there. Holds no global state: one instance per model.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        precision: str = "fp32",
        max_grad_norm: float | None = None,
        scaler: torch.amp.GradScaler | None = None,
        count_comm: bool = True,
        oom_retry: bool = False,
        strategy: Strategy | None = None,
    ):
        """`strategy`: the one that built `model` (engine/parallel/); by default the one the
        model was wrapped for (DDP, or FSDP `every_micro_step` for a sharded model)."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}")
        self.strategy = strategy or strategy_of(model)
        if self.strategy.model is None:
            self.strategy.adopt(model)
        if self.strategy.model is not model:
            raise ValueError("the strategy serves another model than the one given")
        # what the strategy promises, read once: the window rule and who steps are chosen here
        contract = self.strategy.contract
        engine_steps = contract.steps == "engine"
        if precision == "fp16" and contract.lockstep and not engine_steps:
            # GradScaler's unscale and inf checks are per rank: sharded gradients would need
            # them agreed over the ranks, which the engine does not do
            raise ValueError(f"fp16 with a GradScaler under {self.strategy.name}: not supported")
        if oom_retry and not contract.retries_out_of_memory:
            raise ValueError(f"out-of-memory retries under {self.strategy.name}: not supported")
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.precision = precision
        self.max_grad_norm = max_grad_norm
        self.device = next(model.parameters()).device
        self.group = self.strategy.process_group
        distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(self.group) if distributed else 1
        # every rank's figures ride the window's reduction (engine/figures.py)
        self._figures = RankFigures(self.group, self.strategy.figures_group)
        if precision == "fp16" and not engine_steps:
            self.scaler = scaler or torch.amp.GradScaler(self.device.type)
        else:
            # an engine that owns the step owns fp16's loss scale too (DeepSpeed's own scaler)
            if scaler is not None:
                raise ValueError("a GradScaler is only used with fp16, where the step is ours")
            self.scaler = None
        # a reduction that sums over ranks leaves the one multiply below to divide by N; DDP's
        # default hook (count_comm=False) has averaged them already
        sums = self.strategy.setup_reduction(count_comm)
        self._rank_factor = 1.0 if sums else float(self.world_size)
        # the noise scale's small batches, as the reduction hooks see them (engine/noise.py):
        # this rank's sums of a window ride in the next window's reduction
        local = self.strategy.local_gradients() if self.world_size > 1 else None
        self.noise_probe = NoiseProbe(local) if local is not None else None
        self.oom_retry = oom_retry
        self._agree_forwards = contract.lockstep and self.world_size > 1
        self._count_first = self.scaler is not None or contract.window_rule == "count_first"
        self._normalise_clip_step = self._engine_step if engine_steps else self._own_step
        self._run_window = self._pipelined if contract.pipelined else self._micro_steps
        # all parameters (those the optimizer holds now) on one device in one dtype: the
        # gradient norm skips the grouping by device and dtype
        self._uniform_params = (
            len({(p.device, p.dtype) for g in optimizer.param_groups for p in g["params"]}) <= 1
        )
        self._rss_read_at = -math.inf
        self._rss_peak_mb = 0.0
        self.micro_batch_splits = 1
        """With `oom_retry`: an out-of-memory error on any rank in a micro-step before the
        window's last makes every rank cut each micro-batch in two (for this and every later
        window) and run the window again; the gradient sum, and so the step, stays the same.
        It costs one small all-reduce per window, before the last micro-step."""

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        return autocast(self.device.type, self.precision)

    def _all_reduce_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        # a CPU–GPU sync point on GPU: the counts decide the scale of every backward
        return all_reduce(t, group=self.group).tolist()

    def settle_noise(self) -> tuple[float, float] | None:
        """The last window's (tr Σ, |G|²) now, its sums reduced on their own (one small
        all-reduce; every rank calls it alike) — where no next window is sure to bring them;
        None where nothing is measured or waits."""
        if self.noise_probe is None or not self.noise_probe.pending:
            return None
        return self.noise_probe.settled(self._all_reduce_sum(self.noise_probe.sums))

    def __call__(
        self,
        micro_batches: Sequence[Batch],
        loss_fn: LossFn,
        count_items: ItemCounter = count_rows,
        local_items: int | Sequence[int] | None = None,
        signal: bool = False,
        figures: Sequence[float] = (),
    ) -> StepResult:
        """`local_items`: this rank's loss items in the window (or in each micro-batch) when the
        caller already knows them (counted on the host before the batches moved to the GPU,
        where counting would stall the host once per micro-batch); otherwise `count_items`
        counts them (per micro-batch where the noise scale needs them). `signal`:
        this rank raises a flag every rank sees counted in `StepResult.signals`.
        `figures`: figures of this rank (the same number on every rank) that every rank
        receives in `StepResult.figures_by_rank`; known before the window's last backward, so a
        caller reports its previous window's times."""
        t_start = time.perf_counter()
        per_batch = list(local_items) if isinstance(local_items, Sequence) else None
        if local_items is None:
            per_batch = [count_items(mb) for mb in micro_batches]
        local_items = sum(per_batch) if per_batch is not None else local_items
        while True:
            given, per = micro_batches, per_batch
            if self.micro_batch_splits > 1:
                given = [p for mb in micro_batches for p in split_rows(mb, self.micro_batch_splits)]
                per = None
            if self.noise_probe is not None:
                self.noise_probe.unit_items = per or [count_items(mb) for mb in given]
            result = self._window(t_start, given, loss_fn, local_items, signal, figures)
            if result is not None:
                return result
            # some rank ran out of memory: all ranks retry with half the micro-batch
            self.micro_batch_splits *= 2

    def _window(
        self,
        t_start: float,
        micro_batches: Sequence[Batch],
        loss_fn: LossFn,
        local_items: int,
        signal: bool = False,
        figures: Sequence[float] = (),
    ) -> StepResult | None:
        """One attempt at the window; None when an out-of-memory retry is due."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.strategy.begin_window()
        n_micro = len(micro_batches)
        if n_micro == 0:
            raise ValueError("empty window: no micro-batches on this rank")
        if self._agree_forwards:
            # every forward is a collective: a rank with one micro-step more would wait in it
            # forever, so the ranks agree on the count first (a small all-reduce per window)
            _, sum_m, sum_m2 = self._all_reduce_sum([0.0, n_micro, n_micro**2])
            self._check_micro_steps(n_micro, sum_m, sum_m2)
        # this rank's items, samples and micro-steps (and their square, for the parity check)
        counts = [local_items, sum(count_rows(mb) for mb in micro_batches), n_micro, n_micro**2]
        lr = float(self.optimizer.param_groups[0]["lr"])
        # fp16 needs the exact scale before backward (GradScaler's range is tuned to gradients
        # of the mean), which costs an all-reduce before the first micro-step; fp32 and bf16
        # back-propagate item-loss sums and divide once the total is known, after backward
        scale = self._scale_before_backward(counts) if self._count_first else None
        self._clear_grads()
        noise_in = self.noise_probe.riding() if self.noise_probe is not None else []
        if self.noise_probe is not None:
            # the reduction sees the gradients of the sums times what the backward scales by
            loss_scale = self.scaler.get_scale() if self.scaler is not None else 1.0
            self.noise_probe.factor = (1.0 if scale is None else scale) * loss_scale
        stats = self._run_window(
            micro_batches,
            loss_fn,
            [*counts, int(signal)],
            scale,
            [*noise_in, *self._figures.slots(figures)],
        )
        if stats is None:
            return None
        k = len(figures)
        total_loss, items, samples, sum_m, sum_m2, signals, group = self._reduced(
            stats, k, len(noise_in)
        )
        # (tr Σ, |G|²) of the window before, from its units' sums over every rank
        sums = list(group[: len(noise_in)])
        group = self._figures.completed(group[len(noise_in) :], self.device)
        noise = self.noise_probe.arrived(sums) if self.noise_probe is not None else None
        if scale is None:
            self._check_micro_steps(n_micro, sum_m, sum_m2)
        if items == 0 or not math.isfinite(total_loss):
            # every rank sees the same all-reduced sums, so all skip together
            self._clear_grads()
            if self.noise_probe is not None:  # no noise estimate of a window that did not step
                self.noise_probe.stepped(None, items)
            why = "no loss items" if items == 0 else "non-finite loss"
            return self._result(
                t_start,
                math.nan,
                items,
                samples,
                n_micro,
                math.nan,
                lr,
                why,
                signals,
                group_figures=group,
                rank_width=k,
            )
        t_optimizer = time.perf_counter()
        grad_norm, skip_reason = self._normalise_clip_step(items, divided=scale is not None)
        self._clear_grads()
        if self.noise_probe is not None:
            finite = skip_reason is None and math.isfinite(grad_norm)
            self.noise_probe.stepped(grad_norm**2 if finite else None, items)
        loss = total_loss / items
        return self._result(
            t_start,
            loss,
            items,
            samples,
            n_micro,
            grad_norm,
            lr,
            skip_reason,
            signals,
            group_figures=group,
            rank_width=k,
            optimizer_time_s=time.perf_counter() - t_optimizer,
            noise=noise,
        )

    def _scale_before_backward(self, counts: list[int]) -> float:
        """fp16: 1 / N_window (× W after DDP's averaging hook), known before the first
        backward at the cost of an all-reduce of the counts."""
        items, _, sum_m, sum_m2 = self._all_reduce_sum([float(c) for c in counts])
        self._check_micro_steps(counts[2], sum_m, sum_m2)
        return self._rank_factor / items if items else 0.0

    def _micro_steps(
        self,
        micro_batches: Sequence[Batch],
        loss_fn: LossFn,
        counts: list[int],
        scale: float | None,
        slots: list[float],
    ) -> torch.Tensor | None:
        """Forward and backward of every micro-batch, gradients synced on the last one only;
        the window's statistics for the all-reduce, or None when an out-of-memory retry is
        due. `counts`: items, samples, micro-steps, their square and the signal."""
        n_micro = len(micro_batches)
        micro_sums: list[torch.Tensor] = []
        stats = None
        out_of_memory = None
        for i, mb in enumerate(micro_batches):
            last = i == n_micro - 1
            if (
                last
                and self.oom_retry
                and self._any_rank_out_of_memory(out_of_memory, micro_batches)
            ):
                return None
            if out_of_memory is not None:
                continue
            try:
                with self.strategy.sync_context(last):
                    with self._autocast():
                        item_losses = loss_fn(self.model, mb)
                    # an objective that counts its own items hands them over with its losses
                    micro_sum, counted = summed(item_losses)
                    counts[0] += counted
                    micro_sums.append(micro_sum.detach())
                    if last:
                        # summed over ranks with the gradients: loss, items, samples, a
                        # micro-step parity check (Σm² · W == (Σm)² exactly when every rank ran
                        # the same m) and the caller's signal
                        stats = self._window_stats(micro_sums, [*counts, *slots])
                        # counts stay exact in a float32 bucket below 2**24
                        exact = max(counts[0], counts[3]) * self.world_size < 2**24
                        exact = exact and float(counts[0]).is_integer()  # weights: float64
                        self.strategy.attach_window_stats(stats, exact_in_fp32=exact)
                    scaled = micro_sum if scale is None else micro_sum * scale
                    if self.scaler is not None:
                        scaled = self.scaler.scale(scaled)
                    self.strategy.backward(scaled)
                    if self.noise_probe is not None:
                        self.noise_probe.after_backward(i, counted)
            except torch.OutOfMemoryError as exc:
                # before the last micro-step nothing has synced: the window can be redone
                if last or not self.oom_retry:
                    raise
                out_of_memory = exc
                item_losses = micro_sum = scaled = None
        return stats

    def _pipelined(
        self,
        micro_batches: Sequence[Batch],
        loss_fn: LossFn,
        counts: list[int],
        scale: float | None,
        slots: list[float],
    ) -> torch.Tensor:
        """`_micro_steps` as one call of the strategy's pipeline schedule (see engine/parallel/)."""
        if not self.strategy.holds_loss:  # the losses' rank counts the items and samples
            counts[0] = counts[1] = 0
        sums, counted = self.strategy.run_pipeline(micro_batches, loss_fn)
        counts[0] += counted
        values = [math.fsum(sums), *counts, *slots]
        return torch.tensor(values, dtype=torch.float64, device=self.device)

    def _reduced(
        self, stats: torch.Tensor, k: int, extra: int = 0
    ) -> tuple[float, int, int, float, float, int, tuple[float, ...]]:
        """(loss sum, items, samples, Σm, Σm², signals, then the `extra` sums and every
        rank's `k` figures flat) over all ranks."""
        reduced = self.strategy.reduced_window_stats(stats, group=self.group)
        # a CPU–GPU sync point on GPU: whether to step depends on these
        values = reduced.tolist()
        total_loss, items, samples, sum_m, sum_m2, signals = values[:6]
        figures = tuple(values[6:]) if k or extra else ()
        # a count is whole but for a weighted objective's (a sum of weights)
        items = int(items) if float(items).is_integer() else items
        return total_loss, items, int(samples), sum_m, sum_m2, int(signals), figures

    def _engine_step(self, items: int, divided: bool) -> tuple[float, str | None]:
        """The strategy's engine clips (as configured from max_grad_norm) and steps; then the
        schedule."""
        grad_norm, skip_reason = self.strategy.optimizer_step()
        if skip_reason is None and self.scheduler is not None:
            self.scheduler.step()
        return grad_norm, skip_reason

    def _own_step(self, items: int, divided: bool) -> tuple[float, str | None]:
        """Unscale → normalise → clip → step → schedule; (gradient norm, why skipped or None).
        `divided`: the loss was already scaled by 1 / N before backward (fp16)."""
        grads = [
            p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None
        ]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        # the one normalisation: × 1 / N (× W / N after DDP's averaging hook) turns the gradient
        # of the window's item-loss sum into that of the mean item loss over the whole window;
        # it is folded into clipping's multiply, one pass over the gradients for both
        factor = 1.0 if divided else self._rank_factor / items
        grad_norm = self._grad_norm(grads) * factor if grads else 0.0
        if self.max_grad_norm is not None and math.isfinite(grad_norm):
            factor *= min(1.0, self.max_grad_norm / (grad_norm + 1e-6))
        if factor != 1.0 and grads:
            torch._foreach_mul_(grads, factor)

        skip_reason = None
        if self.scaler is not None:
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            # GradScaler backs the scale off exactly when it found inf/nan and skipped the step
            if self.scaler.get_scale() < scale_before:
                skip_reason = "fp16 gradient overflow"
        elif math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            skip_reason = "non-finite gradient"
        if skip_reason is None and self.scheduler is not None:
            self.scheduler.step()
        return grad_norm, skip_reason

    def _grad_norm(self, grads: list[torch.Tensor]) -> float:
        # a CPU–GPU sync point on GPU: clipping and the non-finite skip decide on it
        return float(self.strategy.grad_norm(grads, self._uniform_params))

    def _clear_grads(self) -> None:
        """Every gradient dropped (the strategy's own buffers too); without zero_grad's profiler
        scope, which costs as much as the loop itself on a small model."""
        self.strategy.discard_grads(self.optimizer)

    def _window_stats(self, micro_sums: list[torch.Tensor], counts: list[int]) -> torch.Tensor:
        """[loss sum, *counts] in float64: the loss summed in float64 whatever its dtype."""
        loss = torch.stack(micro_sums).sum(dtype=torch.float64).reshape(1)
        return torch.cat([loss, torch.tensor(counts, dtype=torch.float64, device=self.device)])

    def _check_micro_steps(self, n_micro: int, sum_m: float, sum_m2: float) -> None:
        if sum_m2 * self.world_size != sum_m * sum_m:
            self._clear_grads()
            raise MicroStepMismatchError(
                f"ranks hold different numbers of micro-batches for this window (this rank: "
                f"{n_micro}, mean over {self.world_size} ranks: {sum_m / self.world_size:g}); "
                "every rank must run the same micro-steps or a plain DDP loop hangs"
            )

    def _any_rank_out_of_memory(
        self, error: BaseException | None, micro_batches: Sequence[Batch]
    ) -> bool:
        """Agrees, before the window's syncing micro-step, whether any rank ran out of memory;
        if so every rank drops the window's gradients (and raises when a micro-batch is down to
        one row and cannot be cut)."""
        unsplittable = min(count_rows(mb) for mb in micro_batches) < 2
        oom, stuck = self._all_reduce_sum([float(error is not None), float(unsplittable)])
        if not oom:
            return False
        self._clear_grads()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        if stuck:
            raise torch.OutOfMemoryError(
                f"out of memory on {int(oom)} rank(s) with micro-batches already cut "
                f"{self.micro_batch_splits}× down to one row: the model does not fit; "
                "use a smaller model or sequence, or more memory per worker"
            ) from error
        return True

    def _result(
        self,
        t_start: float,
        loss: float,
        items: int,
        samples: int,
        micro_steps: int,
        grad_norm: float,
        lr: float,
        skip_reason: str | None,
        signals: int = 0,
        group_figures: tuple[float, ...] = (),
        rank_width: int = 0,
        optimizer_time_s: float = 0.0,
        noise: tuple[float, float] | None = None,
    ) -> StepResult:
        if self.device.type == "cuda":
            peak_mb = torch.cuda.max_memory_allocated(self.device) / 2**20
        else:
            now = time.perf_counter()
            # a system call that costs about 1 % of a small CPU step: read once a second
            if now - self._rss_read_at > 1.0:
                # Linux reports ru_maxrss in KiB
                self._rss_peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                self._rss_read_at = now
            peak_mb = self._rss_peak_mb
        comm = self.strategy.comm_stats(micro_steps)
        return StepResult(
            loss=loss,
            items=items,
            samples=samples,
            micro_steps=micro_steps,
            grad_norm=grad_norm,
            lr=lr,
            skipped=skip_reason is not None,
            skip_reason=skip_reason,
            allreduce_calls=comm.allreduce_calls,
            reduce_scatter_calls=comm.reduce_scatter_calls,
            all_gather_calls=comm.all_gather_calls,
            tensor_parallel_calls=comm.tensor_parallel,
            pipeline=comm.pipeline,
            sync_passes=comm.sync_passes,
            step_time_s=time.perf_counter() - t_start,
            sync_time_s=comm.sync_time_s,
            peak_memory_mb=peak_mb,
            micro_batch_splits=self.micro_batch_splits,
            signals=signals,
            optimizer_time_s=optimizer_time_s,
            group_figures=group_figures,
            rank_width=rank_width,
            noise=noise,
        )
