"""`rayacc report RUN` on an elastic run that was preempted: workers, global batch and
accumulation over time with the events marked, and the goodput split, read from a real MLflow
store written the way a fit writes it."""

from __future__ import annotations

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from tests.support.services.cli import rayacc_here


def record_run(uri: str) -> str:
    client = MlflowClient(uri)
    exp = client.create_experiment("elastic")
    run = client.create_run(exp, tags={"rayacc.run_name": "rayacc-x"})
    rid = run.info.run_id
    t0 = 1_800_000_000_000
    metrics = []
    for step in range(1, 13):
        workers = 2 if step <= 6 else 1
        at = t0 + step * 1000 + (30_000 if step > 6 else 0)  # a 30 s restart after step 6
        metrics += [
            Metric("scaling/num_workers", workers, at, step),
            Metric("scaling/global_batch_size", 32, at, step),
            Metric("scaling/grad_accum_steps", 4 if workers == 2 else 8, at, step),
        ]
    split = {"training_s": 12.0, "startup_s": 10.0, "restarts_s": 30.0, "checkpoint_s": 1.0}
    split |= {"recomputed_s": 0.0, "other_s": 1.0, "wall_s": 54.0, "fraction": 12 / 54}
    split |= {"restarts": 1.0, "steps_recomputed": 0.0}
    metrics += [Metric(f"goodput/{k}", v, t0 + 60_000, 12) for k, v in split.items()]
    # every rank's own time per window at each logging interval (2 steps) while 2 ran
    for step in (2, 4, 6):
        metrics += [
            Metric("rank_0/own_s", 0.2, t0 + step * 1000, step),
            Metric("rank_1/own_s", 0.5, t0 + step * 1000, step),
        ]
    client.log_batch(rid, metrics=metrics)
    client.set_tag(
        rid,
        "rayacc.preemptions",
        "step 4: node abc (ranks 1), deadline in 14.0 s, checkpoint 0.3 s, 13.7 s to spare; "
        "step 6: last checkpoint, 2.1 s before the deadline",
    )
    client.set_tag(rid, "rayacc.resizes", "step 6: workers 2→1, accum 4→8, global 32→32")
    client.set_tag(rid, "rayacc.resumed_at_steps", "6")
    client.set_tag(
        rid,
        "rayacc.stragglers",
        "step 4: rank 1 on node 10.0.0.2/ab12cd34, compute (2.50× the others' median)",
    )
    client.set_terminated(rid)
    return rid


def test_report_of_a_preempted_elastic_run(tmp_path, capsys, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    rid = record_run(uri)
    # the run by its MLflow id or its rayacc name (as sample, export and --resume take it), or
    # its experiment (no sweep there)
    for target in (rid, "rayacc-x", "elastic"):
        out_dir = tmp_path / f"report-{target}"
        ran = rayacc_here(
            ["report", target, "--tracking-uri", uri, "--out", str(out_dir)], capsys, monkeypatch
        )
        assert ran.code == 0, ran.out + ran.err
        out = ran.out
        assert f"run rayacc-x ({rid}): 12 optimizer steps" in out, out
        assert "workers: 2 → 1" in out and "global batch: 32\n" in out, out
        assert "accumulation: 4 → 8" in out, out
        lines = out.splitlines()
        events = [line.strip() for line in lines if line.strip().startswith("step ")]
        assert events == [
            "step 4: preemption: node abc (ranks 1), deadline in 14.0 s, checkpoint 0.3 s, "
            "13.7 s to spare",
            "step 4: straggler: rank 1 on node 10.0.0.2/ab12cd34, compute (2.50× the others' "
            "median)",
            "step 6: resize: workers 2→1, accum 4→8, global 32→32",
            "step 6: preemption: last checkpoint, 2.1 s before the deadline",
            "step 6: resumed: from the checkpoint of this step",
        ], events
        assert "goodput 22%: training 12.0 s of 54.0 s" in out and "0 steps recomputed" in out
        steps = (out_dir / "steps.csv").read_text().splitlines()
        assert steps[0] == "step,seconds,workers,global batch,accumulation"
        assert steps[7] == "7,36.00,1.0,32.0,8.0", steps[7]  # the restart's 30 s in the time
        ranks = (
            "ranks: 2; own time per window, mean over the run: median 350 ms, slowest rank 1 500 ms"
        )
        assert ranks in out, out
        for name in ("scaling_over_time.png", "ranks_over_time.png"):
            png = out_dir / name
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_the_ranks_and_the_straggler_read_back(tmp_path):
    from rayacc.tracking.run_report import build_run_report

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    rid = record_run(uri)
    client = MlflowClient(uri)
    report = build_run_report(client, client.get_run(rid))
    assert report.ranks == {0: [(2, 0.2), (4, 0.2), (6, 0.2)], 1: [(2, 0.5), (4, 0.5), (6, 0.5)]}
    assert report.stragglers == [1]


def test_a_sweep_is_found_by_its_name_and_an_unknown_name_lists_what_exists(tmp_path):
    import pytest

    from rayacc.tracking.report import ReportError, build_report

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("sweeps-here")
    parent = client.create_run(exp, tags={"rayacc.sweep": "true"}, run_name="accum-sweep")
    child = client.create_run(
        exp, tags={"mlflow.parentRunId": parent.info.run_id, "rayacc.trial": "0"}
    )
    client.log_batch(child.info.run_id, metrics=[Metric("train/loss", 1.0, 0, 1)])
    # the sweep file's `name:` (neither a run id nor an experiment)
    assert build_report(uri, "accum-sweep").parent_run_id == parent.info.run_id
    with pytest.raises(ReportError) as info:
        build_report(uri, "acum-sweep")
    message = str(info.value)
    assert "sweeps: accum-sweep" in message and "sweeps-here" in message and "Fix:" in message


def test_the_batch_schedule_the_shares_and_the_noise_scale_read_back(tmp_path):
    # as the driver writes them: the events' tags (their own describe()) and the smoothed
    # noise scale per step
    from rayacc.observe.events import BatchPhaseChanged, SharesChanged
    from rayacc.tracking.run_report import build_run_report

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    rid = record_run(uri)
    client = MlflowClient(uri)
    phase = BatchPhaseChanged(3, 96, 32, 64, 4, 8, 0.2)
    moved = SharesChanged(8, (32, 32), (40, 24), "rank 1: 2.00× the fastest rank's time per row")
    client.set_tag(rid, "rayacc.batch_phases", phase.describe())
    client.set_tag(rid, "rayacc.shares", moved.describe())
    noise = [Metric("grad/noise_scale", v, 1_800_000_000_000, s) for s, v in ((3, 40.0), (9, 55.5))]
    client.log_batch(rid, metrics=noise)
    report = build_run_report(client, client.get_run(rid))
    assert (3, "batch schedule", "from sample 96, global 32→64, accum 4→8, effective LR 0.2") in (
        report.events
    )
    assert (8, "shares", "32+32→40+24") in report.events
    assert report.noise == [(3, 40.0), (9, 55.5)]
    said = "\n".join(report.lines())
    assert "gradient noise scale (B_simple, smoothed): 40 at step 3, 55.5 at step 9" in said
