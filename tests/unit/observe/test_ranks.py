"""observe/ranks.py: every rank's figures per window and per logging interval, and the rule that
names a straggler (its own time above the others' median by the margin, two intervals in a
row), checked on figures made up window by window."""

from __future__ import annotations

import pytest

from rayacc.observe.events import RunStarted
from rayacc.observe.ranks import FIELDS, FIGURES_KEY, Straggler, StragglerJudge, rank_figures
from rayacc.observe.relay import FiguresRelay


def figures(compute=0.2, data=0.01, sync=0.05, optimizer=0.01, host=500.0, device=100.0):
    return rank_figures(
        step_s=compute + sync + optimizer,
        sync_s=sync,
        optimizer_s=optimizer,
        data_s=data,
        host_mb=host,
        device_mb=device,
    )


def even(world=4, **slow):
    """One window's reports: every rank alike, rank r's fields changed by slow[r]."""
    return [figures(**slow.get(f"r{r}", {})) for r in range(world)]


def flat(reports):
    """One window's reports as the step's reduction leaves them: rank after rank."""
    return [v for report in reports for v in report]


def run(watch, windows):
    """Feeds windows 1..n; returns (step, straggler) for every one named."""
    named = []
    for step, reports in enumerate(windows, start=1):
        _, straggler = watch.window(step, flat(reports))
        if straggler is not None:
            named.append((step, straggler))
    return named


SLOW_COMPUTE = {"r2": {"compute": 0.5}}
SLOW_DATA = {"r1": {"data": 0.4}}


@pytest.mark.parametrize(
    ("case", "windows", "expect"),
    [
        ("even ranks", [even()] * 12, []),
        # tens of ms on windows of 20 ms: far above 30 % but below the 0.1 s floor
        (
            "tiny windows, uneven by milliseconds",
            [[figures(compute=0.04 if r == 1 else 0.01) for r in range(4)]] * 12,
            [],
        ),
        (
            "one rank slow in compute from the start",
            [even(**SLOW_COMPUTE)] * 12,
            [(4, 2, "compute")],
        ),
        ("one rank slow in its data", [even(**SLOW_DATA)] * 12, [(4, 1, "data")]),
        # slow in one interval only (steps 3-4): a blip, not a straggler
        ("a blip of one interval", [even()] * 2 + [even(**SLOW_COMPUTE)] * 2 + [even()] * 8, []),
        # slow from step 5 on: named at the end of its second slow interval (step 8)
        ("slow from the middle", [even()] * 4 + [even(**SLOW_COMPUTE)] * 8, [(8, 2, "compute")]),
        # named once per streak: recovered at steps 5-8, slow again from 9 → named again at 12
        (
            "slow, recovered, slow again",
            [even(**SLOW_COMPUTE)] * 4 + [even()] * 4 + [even(**SLOW_COMPUTE)] * 4,
            [(4, 2, "compute"), (12, 2, "compute")],
        ),
        ("two ranks", [even(2, r1={"compute": 0.6})] * 6, [(4, 1, "compute")]),
        ("one rank: nobody to compare with", [even(1, r0={"compute": 9.0})] * 6, []),
    ],
)
def test_a_straggler_is_named_within_two_intervals_and_an_even_run_names_none(
    case, windows, expect
):
    watch = StragglerJudge(2, nodes=[f"10.0.0.{r}/n{r}" for r in range(4)])
    named = run(watch, windows)
    assert [(step, s.rank, s.part) for step, s in named] == expect, case
    for _, s in named:
        assert s.node == f"10.0.0.{s.rank}/n{s.rank}"
        assert s.ratio > 1.3 and s.intervals == 2
        assert f"rank {s.rank} on node {s.node}" in s.console_line()
        assert s.part in s.describe()


def test_a_straggler_on_a_mesh_is_named_with_its_place():
    places = [f"dp {r // 2} · tp {r % 2}" for r in range(4)]
    watch = StragglerJudge(2, nodes=[f"n{r}" for r in range(4)], places=places)
    ((_, s),) = run(watch, [even(**SLOW_COMPUTE)] * 4)
    assert s.place == places[s.rank] and f"rank {s.rank} ({places[s.rank]}) on node" in (
        s.console_line()
    )
    assert f"({places[s.rank]})" in s.describe()


def test_the_window_and_interval_figures():
    watch = StragglerJudge(3, nodes=())
    reports = even(3, r1={"compute": 0.5, "device": 300.0})
    first, _ = watch.window(1, flat(reports))
    own = [0.22, 0.52, 0.22]  # compute + data + optimizer
    assert first["ranks/own_s_median"] == pytest.approx(0.22)
    assert first["ranks/own_s_max"] == pytest.approx(0.52)
    assert first["ranks/slowest"] == 1.0
    assert not any(k.startswith("rank_") for k in first), "per rank only at an interval's end"
    watch.window(2, flat(even(3, r1={"device": 900.0})))
    third, _ = watch.window(3, flat(even(3)))
    for r in range(3):
        assert set(FIELDS) == {k.split("/")[1] for k in third if k.startswith(f"rank_{r}/")}
    # means over the interval's three windows; memory its peak
    assert third["rank_1/compute_s"] == pytest.approx((0.5 + 0.2 + 0.2) / 3)
    assert third["rank_1/own_s"] == pytest.approx((own[1] + 0.22 + 0.22) / 3)
    assert third["rank_1/device_mb"] == 900.0
    assert third["rank_0/device_mb"] == 100.0
    # the next interval starts afresh
    fourth, _ = watch.window(4, flat(even(3)))
    assert not any(k.startswith("rank_") for k in fourth)


def test_no_reports_no_figures_and_a_new_worker_count_starts_over():
    watch = StragglerJudge(2)
    assert watch.window(1, ()) == ({}, None)  # a group's first window: nothing sent yet
    run(watch, [even(4, r1={"compute": 0.6})] * 2)  # one slow interval at 4 workers
    # resized to 2 workers: the streak at 4 does not carry over
    named = run(watch, [even(2, r1={"compute": 0.6})] * 2)
    assert named == []


def test_a_tenth_of_the_run_is_the_interval():
    sizes = (1, 9, 10, 14, 100, 1001)
    assert [StragglerJudge.interval_for(n) for n in sizes] == [1, 1, 1, 2, 10, 101]


def test_a_ranks_report_splits_its_window():
    report = rank_figures(
        step_s=1.0, sync_s=0.3, optimizer_s=0.1, data_s=0.2, host_mb=10.0, device_mb=20.0
    )
    assert dict(zip(FIELDS, report, strict=True)) == pytest.approx(
        {
            "compute_s": 0.6,
            "data_s": 0.2,
            "sync_s": 0.3,
            "optimizer_s": 0.1,
            "own_s": 0.9,  # compute, data and optimizer: what makes a rank slower than others
            "host_mb": 10.0,
            "device_mb": 20.0,
        }
    )


def test_each_nodes_system_figures_come_from_its_first_rank():
    watch = StragglerJudge(
        2,
        nodes=["10.0.0.1/aa", "10.0.0.1/aa", "10.0.0.2/bb", "10.0.0.2/bb"],
        system=("cpu_utilization_percentage", "gpu_memory_usage_megabytes"),
    )
    system = {0: [40.0, 1000.0], 1: [0.0, 0.0], 2: [90.0, 3000.0], 3: [0.0, 0.0]}
    for step, cpu_extra in ((1, 0.0), (2, 10.0)):
        reports = [
            [*figures(), system[r][0] + (cpu_extra if system[r][0] else 0), system[r][1]]
            for r in range(4)
        ]
        metrics, _ = watch.window(step, flat(reports))
    assert {k: v for k, v in metrics.items() if k.startswith("system/")} == {
        "system/10.0.0.1-aa/cpu_utilization_percentage": 45.0,
        "system/10.0.0.1-aa/gpu_memory_usage_megabytes": 1000.0,
        "system/10.0.0.2-bb/cpu_utilization_percentage": 95.0,
        "system/10.0.0.2-bb/gpu_memory_usage_megabytes": 3000.0,
    }
    assert metrics["rank_0/compute_s"] == pytest.approx(0.2), "the ranks' figures unchanged"


def test_a_node_sampler_reads_mlflows_monitors_once_a_second():
    from rayacc.worker.system import NAMES, NodeSampler

    sampler = NodeSampler(samples=True)
    first = dict(zip(NAMES, sampler.figures(), strict=True))
    assert 0 <= first["cpu_utilization_percentage"] <= 100
    assert first["system_memory_usage_megabytes"] > 0
    assert 0 < first["system_memory_usage_percentage"] < 100
    if sampler.gpu is None:  # no NVIDIA GPU here
        assert first["gpu_utilization_percentage"] == first["gpu_memory_usage_megabytes"] == 0
    assert sampler.figures() is sampler.figures(), "sampled at most once a second"
    assert NodeSampler(samples=False).figures() == [0.0] * len(NAMES)


@pytest.mark.parametrize("interval", [1, 5, 256, 257, 600])
def test_an_intervals_figures_are_those_of_its_windows_however_it_is_folded(interval, monkeypatch):
    """The watch keeps an interval's reports and folds them every FOLD_EVERY windows (3 here):
    its means and peaks are those of every window of the interval, in any case."""
    import random

    from rayacc.observe import ranks

    monkeypatch.setattr(ranks, "FOLD_EVERY", 3)
    rng = random.Random(interval)
    watch = StragglerJudge(interval)
    windows = [[[rng.uniform(0, 1) for _ in FIELDS] for _ in range(3)] for _ in range(2 * interval)]
    ends = {}
    for step, reports in enumerate(windows, start=1):
        metrics, _ = watch.window(step, flat(reports))
        if step % interval == 0:
            ends[step] = metrics
    assert sorted(ends) == [interval, 2 * interval]
    for end, metrics in ends.items():
        held = windows[end - interval : end]
        for r in range(3):
            for i, name in enumerate(FIELDS):
                values = [w[r][i] for w in held]
                want = max(values) if name.endswith("_mb") else sum(values) / interval
                assert metrics[f"rank_{r}/{name}"] == pytest.approx(want, rel=1e-12), (end, r, name)


def test_figures_that_do_not_split_into_reports_are_refused():
    """The watch reads rank r's report at [r·k, (r+1)·k): figures of another width would be
    read as other ranks' figures."""
    watch = StragglerJudge(2, system=("cpu_utilization_percentage",))
    with pytest.raises(ValueError, match="do not split into reports of 8"):
        watch.window(1, flat(even(2)))  # reports without the system figure
    assert watch.window(1, flat([[*figures(), 50.0]] * 2))[0]["ranks/slowest"] == 0.0


def test_the_resident_memory_read_each_window_is_psutils_figure(monkeypatch):
    """The kept /proc/self/statm read gives what psutil gives, follows memory the process
    touches, and psutil stands in where there is no /proc."""
    import os

    import psutil

    from rayacc.worker.system import ResidentMemory

    kept = ResidentMemory()
    assert abs(kept.mb() - psutil.Process().memory_info().rss / 2**20) < 8
    before = kept.mb()
    held = bytearray(96 * 2**20)
    held[::4096] = b"x" * len(held[::4096])  # touched: resident
    assert kept.mb() - before > 80
    del held

    def no_proc(*args, **kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr(os, "open", no_proc)
    fallback = ResidentMemory()
    assert abs(fallback.mb() - kept.mb()) < 8


def started(total_steps=20, nodes=("10.0.0.1/a", "10.0.0.2/b"), step=0):
    return RunStarted(step, total_steps, None, "layout", {}, 0.1, nodes=nodes)


def handed(step, reports, **metrics):
    """Rank 0's hand-over of a step's record: the record and every rank's figures."""
    return {"step": step, "train/loss": 1.0, **metrics, FIGURES_KEY: tuple(flat(reports))}


def test_the_driver_judges_the_ranks_figures_rank_0_hands_over():
    relay = FiguresRelay(margin=0.3)
    assert relay.admit(started()) == [started()]
    # a record without figures (a group's first window) passes as it is
    assert relay.admit({"step": 1, "train/loss": 1.0}) == [{"step": 1, "train/loss": 1.0}]
    slow = {"r1": {"compute": 0.6}}
    (record,) = relay.admit(handed(2, even(2, **slow)))
    # the figures are taken out: nothing logs them as they are
    assert FIGURES_KEY not in record and record["train/loss"] == 1.0
    assert record["ranks/slowest"] == 1.0 and record["ranks/own_s_max"] == pytest.approx(0.62)
    assert "rank_1/own_s" in record  # the interval (2 steps of 20) ends at step 2
    # the slow rank, named within two intervals, ahead of the record of its step
    out = [relay.admit(handed(step, even(2, **slow))) for step in (3, 4)]
    straggler, fourth = out[1]
    assert len(out[0]) == 1 and isinstance(straggler, Straggler), out
    assert (straggler.step, straggler.rank, straggler.node) == (4, 1, "10.0.0.2/b")
    assert straggler.part == "compute" and fourth["step"] == 4
    # a new group starts over: its first intervals name no one yet
    relay.admit(started(step=4, nodes=("10.0.0.1/a", "10.0.0.3/c")))
    assert len(relay.admit(handed(6, even(2, **slow)))) == 1
    # events other than a group's start pass as they are
    assert relay.admit(straggler) == [straggler]
