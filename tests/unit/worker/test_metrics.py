"""A step's record as the rank writes it (worker/metrics.py)."""

from __future__ import annotations

from rayacc.config.batch_split import BatchSplit
from rayacc.engine.result import StepResult
from rayacc.worker.metrics import step_record


def test_the_lr_is_recorded_without_the_schedules_float_noise():
    """A setting's value, not a result: MLflow showed train/lr 0.0006000000000000001."""
    result = StepResult(
        loss=1.0, items=8, samples=8, micro_steps=2, grad_norm=0.5, lr=0.1 * 0.006,
        skipped=False, skip_reason=None, allreduce_calls=1, reduce_scatter_calls=0,
        sync_passes=1, step_time_s=0.1, sync_time_s=0.01, peak_memory_mb=1.0,
    )  # fmt: skip
    assert 0.1 * 0.006 == 0.0006000000000000001
    record = step_record(
        result, step=3, epoch=0, wall_s=0.1, data_s=0.0, split=BatchSplit(8, 4, 2, 1),
        micro_now=4, accum_now=2, skipped_steps=0, rows_read=8, rss_mb=1.0,
        flops_per_item=None, peak_tflops=None, token_items=False,
    )  # fmt: skip
    assert record["train/lr"] == 0.0006 and record["train/loss"] == 1.0


def test_the_noise_scale_is_the_ratio_of_the_smoothed_estimates():
    """tr Σ and |G|² each averaged on its own (the paper's smoothing), then their ratio; a
    run's first window settles its own estimate at once; a window without a new estimate
    logs the smoothed value it carries; the smoothing goes on from a checkpoint's state."""
    from dataclasses import replace
    from types import SimpleNamespace

    from rayacc.engine.noise import NOISE_SMOOTHING as A
    from rayacc.engine.noise import NoiseScale
    from rayacc.worker.telemetry import Telemetry

    base = StepResult(
        loss=1.0, items=8, samples=8, micro_steps=2, grad_norm=0.5, lr=0.1,
        skipped=False, skip_reason=None, allreduce_calls=1, reduce_scatter_calls=0,
        sync_passes=1, step_time_s=0.1, sync_time_s=0.01, peak_memory_mb=1.0,
    )  # fmt: skip
    window = dict(
        step=1, epoch=0, wall_s=0.1, split=BatchSplit(8, 4, 2, 1), micro_now=4, accum_now=2,
        skipped_steps=0, rows_read=8,
    )  # fmt: skip
    settled = [None, (4.0, 0.5)]  # what the step's settle_noise gives, last first

    def telemetry_of(noise: NoiseScale) -> Telemetry:
        step = SimpleNamespace(settle_noise=settled.pop)
        parts = SimpleNamespace(
            accumulate=step, strategy=SimpleNamespace(mesh_coordinates=lambda: ())
        )
        setup = SimpleNamespace(peak_tflops=None, noise=noise, parts=parts)
        return Telemetry(0, setup, token_items=False)

    telemetry = telemetry_of(NoiseScale())
    first = telemetry.record(base, data_s=0.0, **window)
    assert first["grad/noise_scale"] == 8.0 and settled == [None]  # its own, reduced now
    assert telemetry.record(base, data_s=0.0, **window)["grad/noise_scale"] == 8.0  # carried
    second = telemetry.record(replace(base, noise=(10.0, 0.1)), data_s=0.0, **window)
    trace, square = A * 4.0 + (1 - A) * 10.0, A * 0.5 + (1 - A) * 0.1
    assert second["grad/noise_scale"] == trace / square
    kept = NoiseScale()
    kept.load_state_dict(telemetry.noise.state_dict())  # a checkpoint's, restored
    assert telemetry_of(kept).record(base, data_s=0.0, **window)["grad/noise_scale"] == (
        trace / square
    )
    nothing = telemetry_of(NoiseScale())  # settle_noise gives None: not measured
    assert "grad/noise_scale" not in nothing.record(base, data_s=0.0, **window)
