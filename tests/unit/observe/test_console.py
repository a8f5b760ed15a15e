"""What a user reads: progress lines (ETA, LR, tokens/s, named validation metrics), the header,
the summary's words for short runs, FitResult's repr, the console's rule for Ray's records, the
sweep report's answer and plots. No Ray here: the whole-stack check is in test_user_console.py."""

from __future__ import annotations

import io
import math
import re

import pytest
from rich.console import Console

from rayacc.config import TrainConfig
from rayacc.observe.console import (
    Eta,
    ProgressPrinter,
    QuietRayStream,
    clock,
    perf_summary,
    progress_line,
    strategy_line,
)
from rayacc.observe.events import RunStarted


def record(step, **extra):
    return {
        "step": step,
        "train/loss": 1.0 / step,
        "train/lr": 1e-3,
        "train/samples_per_s": 1000.0,
        **extra,
    }


@pytest.mark.parametrize(
    "extra, present, absent",
    [
        (
            {},
            ["step 3/10", "ETA 0:07", "lr 0.001", "1,000 samples/s", "0:03 elapsed"],
            ["tokens/s", "val_", "MFU"],
        ),
        ({"perf/tokens_per_s": 9e3, "perf/mfu": 0.4123}, ["9,000 tokens/s", "MFU 41.2%"], []),
        ({"perf/tokens_per_s": 128000.0}, ["128,000 tokens/s"], ["val_"]),
        ({"val/loss": 0.25}, ["val_loss 0.2500"], ["val_acc", "val "]),
        ({"val/loss": 0.25, "val/accuracy": 0.951}, ["val_loss 0.2500", "val_acc 95.10%"], []),
    ],
)
def test_a_progress_line_names_what_it_shows(extra, present, absent):
    line = progress_line(record(3, **extra), 10, elapsed_s=3.2, eta_s=7.0)
    for text in present:
        assert text in line
    for text in absent:
        assert text not in line


@pytest.mark.parametrize(
    "seconds, text", [(None, "?"), (math.nan, "?"), (0, "0:00"), (61.4, "1:01"), (3725, "1:02:05")]
)
def test_clock(seconds, text):
    assert clock(seconds) == text


def test_the_eta_counts_the_pauses_in_its_span():
    eta = Eta(window_s=30.0)
    eta.restart(0)
    t = 0.0
    for step in range(1, 41):
        t += 1.0
        if step % 10 == 0:
            t += 5.0  # validation every 10 steps: 5 s
        eta.observe(step, t)
    # 40 steps took 60 s: 1.5 s a step with the pauses; 60 left → 90 s
    assert eta.seconds_left(100) == pytest.approx(90.0, rel=0.1)
    # a span without the pauses would say 60 s
    assert eta.seconds_left(100) > 75


def test_the_eta_follows_a_new_rate_after_a_restart():
    eta = Eta(window_s=5.0)
    eta.restart(0)
    for step in range(1, 21):
        eta.observe(step, step * 1.0)
    eta.restart(20)  # a worker group restarted at half the speed
    for step in range(21, 41):
        eta.observe(step, 100.0 + (step - 20) * 2.0)
    assert eta.seconds_left(60) == pytest.approx(40.0, rel=0.05)


def test_the_eta_is_unknown_until_time_passes():
    eta = Eta()
    assert eta.seconds_left(10) is None
    eta.observe(1, 5.0)
    assert eta.seconds_left(10) is None
    eta.observe(2, 5.0)  # arrived together
    assert eta.seconds_left(10) is None


def test_the_printer_prints_every_tenth_and_every_validation():
    console = Console(file=io.StringIO(), width=300)
    printer = ProgressPrinter(console)
    printer.on_event(RunStarted(0, 40, None, "layout", {}, 1e-3))
    for step in range(1, 41):
        printer.on_step(record(step, **({"val/loss": 0.5} if step == 7 else {})))
    lines = [line for line in console.file.getvalue().splitlines() if "step " in line]
    steps = [int(line.split("step ")[1].split("/")[0]) for line in lines]
    assert steps == [4, 7, 8, 12, 16, 20, 24, 28, 32, 36, 40]
    assert all("/40" in line and "ETA" in line and "lr " in line for line in lines)
    assert "val_loss 0.5000" in lines[1]


def test_the_printer_says_when_a_group_redoes_the_steps_before_it():
    console = Console(file=io.StringIO(), width=300)
    printer = ProgressPrinter(console)
    one, two = ({"num_workers": n} for n in (1, 2))
    printer.on_event(RunStarted(0, 8, None, "layout", one, 1e-3))
    printer.on_step(record(1))
    printer.on_event(RunStarted(0, 8, None, "layout", two, 1e-3))
    printer.on_event(RunStarted(4, 8, 4, "layout", one, 1e-3))
    lines = [line.strip() for line in console.file.getvalue().splitlines()]
    assert "restarted from the beginning (no checkpoint yet): workers 1 → 2" in lines, lines
    assert "resumed from the checkpoint at step 4" in lines, lines


def test_an_elastic_run_gives_its_range_and_each_group_its_size_as_it_starts():
    """The header cannot know the first group's size (the cluster decides it): it gives the
    range, and the group says its size and split as it starts; a resize has its own line."""
    from dataclasses import asdict

    from rayacc.config.batch_split import BatchSplit
    from rayacc.driver.prelaunch import prepare
    from rayacc.observe.console import run_header

    cfg = TrainConfig.from_yaml("jobs/digits.yaml", ["scaling.num_workers=[1,3]"])
    header = run_header(cfg, prepare(cfg), "digits")
    assert header[0] == "global batch 256 over 1–3 workers (elastic: each size's split below)"
    assert not any("over workers 3" in line for line in header), header
    console = Console(file=io.StringIO(), width=300)
    printer = ProgressPrinter(console, elastic=True)
    printer.on_event(RunStarted(0, 8, None, "layout", asdict(BatchSplit(256, 32, 8, 1)), 1e-3))
    printer.on_event(RunStarted(4, 8, 4, "layout", asdict(BatchSplit(256, 32, 4, 2)), 1e-3))
    lines = [line.strip() for line in console.file.getvalue().splitlines()]
    started = "a group of 1 workers starts: global batch 256 = micro 32 × accum 8 × workers 1"
    assert lines[0] == started and lines.count(started) == 1, lines
    plain = Console(file=io.StringIO(), width=300)
    ProgressPrinter(plain).on_event(RunStarted(0, 8, None, "l", {"num_workers": 2}, 1e-3))
    assert plain.file.getvalue() == "", "a fixed size is the header's"


@pytest.mark.parametrize(
    "overrides, words",
    [
        (
            [],
            [
                "DDP",
                "precision fp32",
                "activation checkpointing none",
                "shuffled each epoch (seed 0)",
            ],
        ),
        (
            ["train.strategy=fsdp", "fsdp.grad_sync=window_end", "train.precision=bf16"],
            ["FSDP2", "grad_sync window_end", "precision bf16"],
        ),
        (["train.activation_checkpointing=full"], ["activation checkpointing full"]),
        (
            ["train.activation_checkpointing={every_n: 2}"],
            ["activation checkpointing every 2 blocks"],
        ),
        (["data.shuffle=false", "train.compile=true"], ["stored order", "torch.compile"]),
    ],
)
def test_the_header_says_how_the_run_computes(overrides, words):
    cfg = TrainConfig.from_yaml("jobs/shakespeare.yaml", overrides=overrides)
    line = strategy_line(cfg)
    for word in words:
        assert word in line


@pytest.mark.parametrize(
    "steps, which",
    [
        (1, "median of all 1 step)"),
        (2, "median of all 2 steps)"),
        (3, "median of all 3 steps)"),
        (10, "median of steps 4–10)"),
    ],
)
def test_the_summary_says_which_steps_its_medians_cover(steps, which):
    history = [record(s) for s in range(1, steps + 1)]
    assert which in perf_summary(history)


def test_a_fit_results_repr_is_short():
    from rayacc.config.batch_split import BatchSplit
    from rayacc.driver.fit import FitResult

    history = [record(s, **{f"x/{i}": 1.0 for i in range(30)}) for s in range(1, 501)]
    result = FitResult(
        checkpoint_dir="/tmp/c",
        mlflow_run_id="abc",
        metrics={"step": 500, "train/loss": 0.1, "val/loss": 0.2, "val/accuracy": 0.9},
        split=BatchSplit(256, 32, 4, 2),
        effective_lr=1e-3,
        run_name="r",
        storage_path="/tmp",
        tracking_uri=None,
        history=history,
        summary={"timeline": {"x": 1.0}},
    )
    text = repr(result)
    assert len(text) < 400, text
    for part in ("steps=500", "val_acc=0.9", "global_batch=256", "<500 step records>"):
        assert part in text


@pytest.mark.parametrize(
    "text, shown",
    [
        ("2026-12-01 17:36:33,784\tWARNING authentication_token_setup.py:85 -- Token ...\n", False),
        ("2026-12-01 17:37:56,511\tINFO streaming_executor.py:215 -- Starting execution\n", False),
        ("2026-12-01 17:37:55,249\tINFO worker.py:2038 -- Started a local Ray instance.\n", False),
        ("2026-12-01 17:37:56,519\tWARNING __init__.py:28 -- Progress bars disabled.\n", False),
        ("2026-12-01 17:37:56,519\tERROR worker.py:1 -- a task failed\n", True),
        ("  step 2/20  0:30 elapsed  ETA 0:18  loss 4.3461\n", True),
        ("rayacc: warning: something\n", True),
    ],
)
def test_the_console_keeps_rays_records_below_error_out(text, shown):
    out = io.StringIO()
    QuietRayStream(out).write(text)
    assert (out.getvalue() == text) is shown


def test_a_jobs_logs_are_shown_whole_though_they_begin_with_a_ray_record():
    """`rayacc jobs logs ID`: the log text Ray keeps starts with its job manager's INFO record;
    the quiet console dropped the whole text with it (the command printed nothing)."""
    logs = (
        "2026-12-04 11:05:38,175\tINFO job_manager.py:581 -- Runtime env is setting up.\n"
        "Running entrypoint for job raysubmit_x: rayacc train\n"
        "tracking at http://alice:s3cr3t@host:5000\n"
    )
    out = io.StringIO()
    QuietRayStream(out).write_data(logs)
    assert out.getvalue() == logs.replace("alice:s3cr3t", "***")


def test_the_quiet_console_still_masks_credentials():
    out = io.StringIO()
    QuietRayStream(out).write("tracking at http://alice:s3cr3t@host:5000\n")
    assert out.getvalue() == "tracking at http://***@host:5000\n"


def test_a_layout_with_no_full_window_says_so():
    from rayacc.data.order import EpochLayout

    text = EpochLayout(151, 256, 8, 2, "short").describe()
    assert "0 windows" not in text
    assert "one short window of 151 rows" in text


# ----------------------------------------------------------------------------- sweep report
def trial(
    n, *, micro, accum, workers, loss, sps, mem, t, wall, batch=256, status="FINISHED", lr=1e-3
):
    from rayacc.tracking.report import TrialRow

    return TrialRow(
        trial=str(n),
        run_id=f"r{n}",
        status=status,
        workers=workers,
        micro=micro,
        accum=accum,
        global_batch=batch,
        effective_lr=lr,
        final_train_loss=loss,
        best_val=0.9,
        best_val_metric="val/accuracy",
        samples_per_s=sps,
        peak_mem_mb=mem,
        sync_frac=0.1,
        wall_time_s=wall,
        time_to_target_s=t,
    )


@pytest.mark.parametrize(
    "rows, says",
    [
        (
            [
                trial(
                    0,
                    micro=16,
                    accum=16,
                    workers=1,
                    loss=0.2570,
                    sps=14650,
                    mem=592.6,
                    t=0.68,
                    wall=23.6,
                ),
                trial(
                    1,
                    micro=64,
                    accum=4,
                    workers=1,
                    loss=0.2570001,
                    sps=17277,
                    mem=594.0,
                    t=0.36,
                    wall=19.3,
                ),
            ],
            [
                "same final loss 0.2570 in all 2 trials, as expected at one global batch",
                "fastest: trial 1 (micro 64 × accum 4 × 1 worker(s))",
                "1.89× faster than trial 0",
                "fastest first): trial 1 0.36 s, trial 0 0.68 s",
                "highest first): trial 1 17,277, trial 0 14,650",
                "least first): trial 0 593, trial 1 594",
            ],
        ),
        (
            [
                trial(
                    0, micro=16, accum=16, workers=1, loss=0.30, sps=1000, mem=500, t=2.0, wall=9
                ),
                trial(
                    1,
                    micro=16,
                    accum=8,
                    workers=1,
                    loss=0.20,
                    sps=1100,
                    mem=500,
                    t=1.0,
                    wall=8,
                    batch=128,
                ),
            ],
            [
                "final losses differ, 0.2000–0.3000; compared at the loss all reached",
                "fastest: trial 1",
            ],
        ),
        (
            [
                trial(
                    0, micro=16, accum=16, workers=1, loss=0.30, sps=1000, mem=500, t=2.0, wall=9
                ),
                trial(
                    1, micro=16, accum=16, workers=2, loss=0.20, sps=1100, mem=500, t=1.0, wall=8
                ),
            ],
            ["at one global batch they should agree"],
        ),
        (
            [
                trial(
                    0, micro=16, accum=16, workers=1, loss=0.30, sps=1000, mem=500, t=2.0, wall=9
                ),
                trial(
                    1,
                    micro=16,
                    accum=8,
                    workers=1,
                    loss=math.nan,
                    sps=math.nan,
                    mem=math.nan,
                    t=math.nan,
                    wall=3,
                    status="FAILED",
                ),
            ],
            # nothing to compare the one that finished with
            ["one trial finished: trial 0 (micro 16 × accum 16 × 1 worker(s)), final loss 0.3000"],
        ),
        (
            [
                trial(
                    0,
                    micro=16,
                    accum=16,
                    workers=1,
                    loss=0.30,
                    sps=1000,
                    mem=500,
                    t=2.0,
                    wall=9,
                    lr=0.01,
                ),
                trial(
                    1,
                    micro=16,
                    accum=16,
                    workers=1,
                    loss=0.20,
                    sps=1000,
                    mem=500,
                    t=1.0,
                    wall=9,
                    lr=0.1,
                ),
            ],
            # another LR learns otherwise: no promise of the same loss
            ["final losses differ, 0.2000–0.3000; compared at the loss all reached"],
        ),
    ],
    ids=["one-batch", "two-batches", "one-batch-disagreeing", "a-failed-trial", "two-lrs"],
)
def test_the_report_answers_which_setting_is_fastest_for_the_same_result(rows, says):
    from rayacc.tracking.report import Report

    report = Report(
        "parent", rows, target_loss=min(r.final_train_loss for r in rows if r.status == "FINISHED")
    )
    text = "\n".join(report.verdict())
    for words in says:
        assert words in text, text


@pytest.mark.parametrize(
    "curves, coincide",
    [
        ({"a": ([1, 2, 3], [2.0, 1.0, 0.5]), "b": ([1, 2, 3], [2.0, 1.0000001, 0.5])}, True),
        ({"a": ([1, 2, 3], [2.0, 1.0, 0.5]), "b": ([1, 2, 3], [2.0, 1.2, 0.7])}, False),
        ({"a": ([1, 2, 3], [2.0, 1.0, 0.5])}, False),
        ({"a": ([1, 2, 3], [2.0, 1.0, 0.5]), "b": ([1, 2], [2.0, 1.0])}, False),
    ],
)
def test_coinciding_loss_curves_get_a_note(curves, coincide):
    from rayacc.tracking.report import coincide_note

    assert bool(coincide_note(curves)) is coincide


def test_a_quantitys_axis_starts_at_zero(tmp_path):
    from rayacc.tracking.report import _plot_xy

    series = {"1 worker(s)": ([16, 64], [592.6, 594.0])}
    low, high = _plot_xy(tmp_path / "m.png", "t", "x", "MB", series, scatter=True)
    assert low == 0 and high > 594.0
    assert (tmp_path / "m.png").stat().st_size > 0


@pytest.mark.parametrize(
    "losses, times, target, expected",
    [
        ([(1, 2.0), (2, 1.0), (3, 0.5)], {1: 1.0, 2: 1.0, 3: 1.0}, 1.5, 2.0),  # smoothed: 2, 1.5
        ([(1, 2.0), (2, 1.0), (3, 0.5)], {1: 1.0, 2: 1.0, 3: 1.0}, 0.1, math.nan),
    ],
)
def test_time_to_loss(losses, times, target, expected):
    from rayacc.tracking.report import time_to_loss

    got = time_to_loss(losses, times, target)
    assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected)


@pytest.mark.parametrize(
    "workers, cpus, address, warned",
    [
        (4, 1.0, None, True),  # the case: 4 workers on 2 cores
        (2, 2.0, None, True),
        (2, 1.0, None, False),
        (4, 0.5, None, False),
        ([1, 4], 1.0, None, True),  # an elastic run's most
        ([1, 3], 1.0, None, True),
        (4, 1.0, "ray://head:10001", False),  # a cluster: check_cluster judges it
    ],
)
def test_a_local_run_with_more_worker_cpus_than_cores_warns(
    monkeypatch, workers, cpus, address, warned
):
    import os

    from rayacc.driver.prelaunch import local_oversubscription

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    if address:
        monkeypatch.setenv("RAY_ADDRESS", address)
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = TrainConfig.from_dict(
        {
            "batch": {"global_batch_size": 64, "micro_batch_size": 4},
            "scaling": {"num_workers": workers, "cpus_per_worker": cpus},
        }
    )
    warning = local_oversubscription(cfg.scaling)
    assert (warning is not None) is warned
    if warned:
        assert "oversubscribed" in warning and "2 cores" in warning and "Fix:" in warning
        # the value that fits, named (the user had to work it out for [1, 3])
        most = workers[-1] if isinstance(workers, list) else workers
        share = {4: "0.5", 3: "0.5", 2: "1"}[most]
        assert f"Fix: scaling.cpus_per_worker={share} ({most} workers on 2 cores)" in warning


def test_on_a_terminal_the_bar_carries_the_line_and_validations_stay_printed():
    console = Console(file=io.StringIO(), width=200, force_terminal=True)
    with ProgressPrinter(console, 10, bar=True) as printer:
        assert printer.progress is not None
        printer.on_event(RunStarted(0, 10, None, "layout", {}, 1e-3))
        for step in range(1, 11):
            printer.on_step(record(step, **({"val/loss": 0.5} if step == 5 else {})))
        task = printer.progress.tasks[0]
        assert task.completed == 10 and "step 10/10" in task.fields["info"]
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", console.file.getvalue())
    assert "val_loss 0.5000" in text


def test_off_a_terminal_there_is_no_bar():
    printer = ProgressPrinter(Console(file=io.StringIO()), 10, bar=True)
    with printer:
        assert printer.progress is None


def test_the_summary_names_its_validation_metrics_and_says_where_the_time_went():
    from rayacc.config.batch_split import BatchSplit
    from rayacc.driver.fit import FitResult
    from rayacc.observe.console import summary_lines

    cfg = TrainConfig.from_dict({"batch": {"global_batch_size": 8, "micro_batch_size": 4}})
    metrics = {"step": 5, "train/loss": 0.1, "val/loss": 0.2, "val/accuracy": 0.9}
    split = {"training_s": 3.0, "startup_s": 6.0, "restarts_s": 0.0, "checkpoint_s": 0.5}
    split |= {"recomputed_s": 0.0, "other_s": 0.5, "wall_s": 10.0, "fraction": 0.3}
    split |= {"restarts": 0.0, "steps_recomputed": 0.0}
    result = FitResult(
        checkpoint_dir=None,
        mlflow_run_id=None,
        metrics=metrics,
        split=BatchSplit(8, 4, 1, 2),
        effective_lr=1e-3,
        run_name="r",
        storage_path="/tmp",
        tracking_uri=None,
        wall_time_s=10.0,
        goodput=split,
    )
    lines = summary_lines(cfg, result)
    assert "step 5: train loss 0.1000, val_loss 0.2000, val_acc 90.00%" in lines
    assert (
        "goodput 30%: training 3.0 s of 10.0 s (start-up 6.0 s, checkpoints 0.5 s, other 0.5 s); "
        "0 steps recomputed"
    ) in lines, lines


def test_lines_that_arrive_together_say_their_own_steps_time_and_no_eta_before_a_rate():
    """Without a terminal the relay hands records over in bursts: each line counts from the
    time its step ended on the rank (every line of the default job said `0:19 elapsed`), and
    says no ETA until two steps give a rate."""
    from rayacc.observe.ranks import TIME_KEY

    console = Console(file=io.StringIO(), width=300)
    printer = ProgressPrinter(console)
    printer.on_event(RunStarted(0, 10, None, "layout", {}, 1e-3))
    start = printer.started
    for step in range(1, 11):  # one burst, the steps 2 s apart on the rank
        printer.on_step(record(step, **{TIME_KEY: start + 2.0 * step}))
    lines = [line for line in console.file.getvalue().splitlines() if "step " in line]
    assert [line.split("  ")[2] for line in lines] == [f"0:{2 * s:02d} elapsed" for s in
                                                       range(1, 11)]  # fmt: skip
    assert "ETA" not in lines[0] and "ETA 0:00" in lines[-1] and "ETA 0:16" in lines[1]


def test_a_strategy_whose_start_takes_long_says_so_as_the_group_starts():
    """~35 s of DeepSpeed's start with nothing printed: the rank says what starts, first."""
    from rayacc.engine.parallel import strategy_classes
    from rayacc.observe.events import GroupStarting
    from rayacc.worker.setup import say_what_starts

    class Box:
        def __init__(self):
            self.sent, self.flushed = [], 0

        def send(self, item):
            self.sent.append(item)

        def flush(self):
            self.flushed += 1

    said = {}
    for name in strategy_classes():
        box = Box()
        say_what_starts(name, box)
        said[name] = box.sent
        assert box.flushed == bool(box.sent), "said at once, not with the next batch"
    assert said["ddp"] == [] and said["fsdp"] == []
    (starting,) = said["deepspeed"]
    assert isinstance(starting, GroupStarting) and "DeepSpeed" in starting.console_line()
    console = Console(file=io.StringIO(), width=300)
    ProgressPrinter(console).on_event(starting)
    assert "  DeepSpeed: starting its engine" in console.file.getvalue()


@pytest.mark.parametrize("uri", ["http://127.0.0.1:5000", "sqlite:///runs/mlflow.db"])
def test_every_line_the_header_and_summary_print_passes_the_masker_as_it_is(tmp_path, uri):
    """rayacc's own identifiers are never taken for secrets: each line of the header and of
    the summary (the saved view's key after `viewStateShareKey=`, a run's id, its folders)
    leaves the masker unchanged, through the console's stream as through `redact`; a secret
    beside them is still masked."""
    from rayacc.config.batch_split import BatchSplit
    from rayacc.driver.fit import FitResult
    from rayacc.driver.prelaunch import prepare
    from rayacc.observe.console import run_header, summary_lines
    from rayacc.redact import MASK, RedactingStream, redact

    cfg = TrainConfig.from_yaml("jobs/digits.yaml", [])
    result = FitResult(
        checkpoint_dir=str(tmp_path / "runs" / "digits-20261207-191440" / "checkpoint_000012"),
        mlflow_run_id="3f2a9c8e7b6d4e1f9a0b8c7d6e5f4a3b", metrics={"step": 12},
        split=BatchSplit(256, 32, 4, 2), effective_lr=1e-3, run_name="digits",
        storage_path=str(tmp_path / "runs"), tracking_uri=uri,
        mlflow_experiment_id="817263544912345678", wall_time_s=1.0,
    )  # fmt: skip
    console = Console(file=io.StringIO(), width=400)
    for line in [*run_header(cfg, prepare(cfg), "digits"), *summary_lines(cfg, result)]:
        console.print(line)
    lines = console.file.getvalue().splitlines()
    assert any("viewStateShareKey=rayacc-loss-first&" in line for line in lines), lines
    changed = [line for line in lines if redact(line) != line]
    assert not changed, changed
    out = io.StringIO()
    stream = RedactingStream(out)
    stream.write("\n".join(lines) + "\n")
    stream.flush()
    assert out.getvalue().splitlines() == lines
    secret = "api_key=" + "Zq7" * 12
    assert redact(f"{lines[-1]} {secret}") == f"{lines[-1]} api_key={MASK}"


@pytest.mark.parametrize("shuffle", [True, False])
def test_the_header_says_the_data_order_once_and_alike(shuffle):
    """With data.shuffle=false the header said both "stored order" and "an exact per-row
    shuffle": every line that names the order says the same one."""
    from rayacc.driver.prelaunch import prepare
    from rayacc.observe.console import run_header

    cfg = TrainConfig.from_yaml("jobs/digits.yaml", [f"data.shuffle={str(shuffle).lower()}"])
    text = "\n".join([strategy_line(cfg), *run_header(cfg, prepare(cfg), "digits")])
    said, other = ("shuffle", "stored order") if shuffle else ("stored order", "shuffle")
    assert said in text and other not in text, text
