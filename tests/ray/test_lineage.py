"""The run's record is the lineage of its final checkpoint, across every fault at once, on the
whole stack (real Ray, a real `mlflow server`, the `rayacc` command): the driver (joined to
the suite's Ray, as on a cluster) SIGKILLed after a checkpoint and two steps beyond it (steps
no checkpoint keeps, already in MLflow); a resume during which the tracking server is cut off
and back again (a gate in front of the suite's server,
`tests.support.services.mlflow_server.Gate`: to
a client the same as a killed and restarted server) and a worker process is SIGKILLed (Ray
Train restarts the group from the latest checkpoint): under DDP rank 0 in the middle of writing
a checkpoint in the background, which must leave the one before it the run's; under FSDP a rank
in its forward, and the resume also resizes the group (2 workers → 1). MLflow must hold steps
1..N exactly once with the values of an uninterrupted run, and the final weights must be that
run's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from rayacc import TrainConfig, load_model
from rayacc.driver.runs import RUN_INFO
from rayacc.observe.events import RunObserver, RunStarted
from rayacc.observe.ranks import TIME_KEY
from rayacc.tracking.history import DISCARDED_TAG, discarded_marks, lineage_points
from tests.support.services.fits import config, digits_subset, fit_or_fail, rel_diff, weights
from tests.support.services.mlflow_server import Gate

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
FORWARDS_PER_STEP = 4  # per rank: global 32 = micro 4 × accumulation 4 × 2 workers
# the values a step computes (the rest of a record measures time and memory)
COMPUTED = ("train/loss", "train/lr", "train/grad_norm", "train/items", "val/loss")


FAULTY_MODEL = "tests.support.models.faulty_model:build"
PLANTED = "Zq9PlantedPassword"


def spec(tmp_path: Path, strategy: str, workers: int, tracking_uri: str) -> dict:
    return {
        "seed": 7,
        "model": {
            "name": "factory",
            "factory": FAULTY_MODEL,
            "kwargs": {
                "marker": str(tmp_path / "died"),
                # the resumed run (from step 6) loses a worker in step 9 on 1 worker (FSDP;
                # steps 7 and 8 recorded, not checkpointed)
                "die_at_forward": 5 * FORWARDS_PER_STEP + 2,
                "die_rank": -1,
                "kill": True,
                # the first attempt stalls in step 9: steps 7 and 8 are in MLflow only
                "phase_marker": str(tmp_path / "resumed"),
                "hold_at_forward": 8 * FORWARDS_PER_STEP + 1,
                # slow enough that steps 7 and 8 leave rank 0 before the stall (records go
                # out at most every 0.5 s)
                "delay_s": 0.1,
                # masks a resumed run must draw as the uninterrupted one does (a resize
                # starts fresh random streams, so not under FSDP here, which resizes)
                "dropout": 0.1 if strategy == "ddp" else 0.0,
                # under DDP rank 0 dies instead in the middle of writing checkpoint 9 in the
                # background (the resumed run's first), while step 10 trains
                **({"die_in_write": 1} if strategy == "ddp" else {}),
                # and the first attempt's write of checkpoint 6 (its second) fails once as a
                # throttled store's put does: the retry must send the whole checkpoint again,
                # its lineage included, which the resume from 6 carries on
                **({"throttle_in_write": 2} if strategy == "ddp" else {}),
            },
        },
        "data": {"source": digits_subset(tmp_path / "d.parquet", 512), "val_fraction": 0.15},
        "batch": {"global_batch_size": 32, "micro_batch_size": 4},
        "optim": {"name": "adamw", "lr": 0.01, "warmup_steps": 2, "schedule": "cosine"},
        "train": {
            "strategy": strategy,
            "max_steps": STEPS,
            "checkpoint_every_steps": 3,
            "val_every_steps": 4,
        },
        "scaling": {"num_workers": workers, "cpus_per_worker": 0.5},
        "tracking": {"tracking_uri": tracking_uri, "experiment": f"lineage-{strategy}"},
        "run": {"storage_path": str(tmp_path / "runs"), "name": "faulty", "max_failures": 1},
    }


def wait_for_idle_cluster(timeout_s: float = 60) -> None:
    """Until every CPU of the suite's Ray is free again: the actors of a killed driver's job
    have ended (a stalled worker left alive would go on and write a checkpoint)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"]:
        assert time.monotonic() < deadline, f"still in use: {ray.available_resources()}"
        time.sleep(0.2)


def steps_in(client: MlflowClient, run_id: str, key: str = "train/loss") -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_record_is_the_final_checkpoints_lineage_across_every_fault(
    ray_address, mlflow_server, tmp_path, tmp_path_factory, monkeypatch, capfd, strategy
):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    # an outage is a refused connection, not a wait; a server slowed by a loaded machine must
    # not read as one
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    gate = Gate(mlflow_server)
    # a password in the tracking URI (basic auth, which this server does not ask for): it
    # must appear nowhere the run writes or prints
    uri = gate.uri.replace("http://", f"http://rayacc:{PLANTED}@")
    client = MlflowClient(uri)
    try:
        # the uninterrupted run (the stalls and deaths wait for files it never creates...
        # except the phase marker, which it needs to skip the stall)
        clean = tmp_path / "clean"
        clean.mkdir()
        (clean / "resumed").touch()
        (clean / "died").touch()
        uninterrupted = spec(clean, strategy, 2, uri)
        # its forwards need not wait: the delay only spaces the faulty attempts' steps out
        uninterrupted["model"]["kwargs"]["delay_s"] = 0.0
        reference = fit_or_fail(
            TrainConfig.from_dict(
                {
                    **uninterrupted,
                    "tracking": {"enabled": False},
                    "run": {"storage_path": str(clean / "runs")},
                }
            )
        )
        expected = {r["step"]: r for r in reference.history}
        assert sorted(expected) == list(range(1, STEPS + 1))

        # 1. the tracking server dies once step 1 is in MLflow; the run goes on to stall in
        # step 9 (checkpoint at 6; steps 3..8 wait in the driver's memory for the server);
        # then the driver and every process it started are SIGKILLed, and the server returns
        job = tmp_path / "job.yaml"
        job.write_text(yaml.safe_dump(spec(tmp_path, strategy, 2, uri)))
        # the driver joins the suite's Ray, as a driver on a cluster does: killed, its job's
        # actors (Ray Train's controller, the workers) are ended by Ray, not with the driver
        driver = subprocess.Popen(
            [sys.executable, "-m", "rayacc.cli", "train", "-c", str(job)],
            cwd=ROOT,
            env=dict(os.environ, RAY_ADDRESS=ray_address),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        run_dir = tmp_path / "runs" / "faulty"
        first_run = None
        deadline = time.monotonic() + 300
        while first_run is None or not steps_in(client, first_run):
            assert driver.poll() is None, "the first attempt ended before it was killed"
            assert time.monotonic() < deadline, "the first attempt never reached step 1"
            time.sleep(0.2)
            exp = client.get_experiment_by_name(f"lineage-{strategy}")
            runs = client.search_runs([exp.experiment_id]) if exp else []
            first_run = runs[0].info.run_id if runs else None
        gate.close()
        while not (run_dir / "checkpoint_step00000006" / "meta.json").exists():
            assert driver.poll() is None and time.monotonic() < deadline, "no checkpoint 6"
            time.sleep(0.2)
        time.sleep(4)  # steps 7 and 8 (under a second) reach the driver; step 9 stalls
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
        wait_for_idle_cluster()  # the killed job's workers ended: no step 9 after this
        checkpoints = sorted(p.name for p in run_dir.glob("checkpoint_*"))
        assert checkpoints[-1] == "checkpoint_step00000006", checkpoints
        gate.open()
        held = steps_in(client, first_run)
        assert max(held) < 6, f"steps 1..6 must be missing from MLflow for the test: {held}"
        (tmp_path / "resumed").touch()

        # 2. --resume (without run.name: the latest run of this job), on 1 worker under FSDP;
        # the tracking server is cut off when step 8 arrives and is back 3 s after step 10; a worker
        # process is SIGKILLed (in step 12 on 2 workers, in step 9 on 1)
        restarted = threading.Event()
        resumed_from = []

        class Outage(RunObserver):
            def on_event(self, event):
                if isinstance(event, RunStarted):
                    resumed_from.append(event.resumed_from)

            def on_step(self, record):
                if record["step"] == 8 and not restarted.is_set():
                    gate.close()
                if record["step"] == 10 and not restarted.is_set():
                    restarted.set()
                    # back a few seconds later, as a restarted server is: steps 8..10 may
                    # reach the driver in one batch, before any write has met the outage
                    threading.Timer(3.0, gate.open).start()

        workers = 1 if strategy == "fsdp" else 2
        resumed_spec = spec(tmp_path, strategy, workers, uri)
        del resumed_spec["run"]["name"]
        cfg = TrainConfig.from_dict(resumed_spec)
        from rayacc.driver.fit import fit

        box: dict = {}
        t = threading.Thread(
            target=lambda: box.update(r=fit(cfg, resume=True, observers=[Outage()])), daemon=True
        )
        t.start()
        t.join(400)
        assert "r" in box, "the resumed fit did not finish"
        result = box["r"]
        err = capfd.readouterr().err
        assert (tmp_path / "died").exists(), "no worker died: the test proves less than it says"
        if strategy == "ddp":
            assert (tmp_path / "died.throttled").exists(), "no put was throttled"
            # the killed rank's staging copy of checkpoint 9 is gone: the next group on its
            # node removed it
            left = (tmp_path / "died.staging").read_text().split()
            assert left, "the killed rank had no staging folder: the test proves less"
            assert not [p for p in left if Path(p).exists()], left
        assert restarted.is_set() and "tracking server back after" in err, err[-3000:]
        assert "could not be written" not in err, err[-3000:]
        assert result.run_name == "faulty"
        # both groups start from checkpoint 6: under DDP the one of step 9 was cut off in the
        # middle of its write, so it was never the run's (the next attempt wrote it anew)
        assert resumed_from == [6, 6], resumed_from

        # MLflow: one run, whatever the restarts; its lineage holds steps 1..N exactly once,
        # each with the uninterrupted run's values
        run_id = result.mlflow_run_id
        (run,) = client.search_runs([exp.experiment_id])
        assert run.info.run_id == run_id and run.info.status == "FINISHED"

        def points(key):
            return lineage_points(client, run, key)

        def steps_of(key):
            return [m.step for m in points(key)]

        for key in expected[STEPS]:
            value = expected[STEPS][key]
            if key == "step" or key.startswith("val/") or not isinstance(value, int | float):
                continue
            if key == TIME_KEY:  # when the step ended: the metrics' timestamp, not a metric
                continue
            if key.startswith(("ranks/", "rank_", "system/")):
                # every rank's figures arrive one window late: a group's first step has none;
                # still each step at most once, in the lineage's range
                held = steps_of(key)
                assert set(held) <= set(range(2, STEPS + 1)), key
                continue
            assert steps_of(key) == list(range(1, STEPS + 1)), key
        assert steps_of("val/loss") == [4, 8, 12]
        tol = 0.0 if workers == 2 else 1e-5  # a resize changes the float rounding only
        for key in COMPUTED:
            for m in points(key):
                want = expected[m.step][key]
                assert abs(m.value - want) <= tol * abs(want), (key, m.step, m.value, want)
        # every value, measured ones included, is the one the lineage computed: the final
        # checkpoint's records (an attempt no checkpoint kept measured other times)
        final = Path(result.checkpoint_dir) / "history.jsonl"
        lineage = {r["step"]: r for r in map(json.loads, final.read_text().splitlines())}
        assert sorted(lineage) == list(range(1, STEPS + 1))
        for key, value in lineage[STEPS].items():
            if key == "step" or not isinstance(value, int | float):
                continue
            for m in points(key):
                assert m.value == float(lineage[m.step][key]), (key, m.step)
        # and each step's time, the lineage's too (records reach the driver in bursts)
        for m in points("train/loss"):
            assert m.timestamp == int(lineage[m.step][TIME_KEY] * 1000), m.step
        # the steps of the attempts no checkpoint kept stay in the run, marked: every point
        # the lineage passes over lies in a mark, logged before the group that redid it
        marks = discarded_marks(run.data.tags)
        assert marks and all(m.first == 7 for m in marks), run.data.tags[DISCARDED_TAG]
        kept = {(m.step, m.timestamp) for m in points("train/loss")}
        raw = client.get_metric_history(run_id, "train/loss")
        apart = [m for m in raw if (m.step, m.timestamp) not in kept]
        assert apart and all(any(d.covers(m.step, m.timestamp) for d in marks) for m in apart)
        info = json.loads((tmp_path / "runs" / "faulty" / RUN_INFO).read_text())
        assert info["mlflow_run_id"] == run_id and info["status"] == "finished"

        # the fit's own outputs cover the whole lineage too
        assert [r["step"] for r in result.history] == list(range(1, STEPS + 1))
        assert (tmp_path / "runs" / "faulty" / "loss_curve.png").is_file()
        a, b = (
            weights(load_model(r.checkpoint_dir, factory=FAULTY_MODEL)) for r in (reference, result)
        )
        assert rel_diff(b, a) <= (0.0 if workers == 2 else 1e-5), rel_diff(b, a)
        # the run's one logged model, as MLflow's own loader reads it: the final checkpoint's
        import mlflow.pytorch
        import torch

        (output,) = client.get_run(run_id).outputs.model_outputs
        with mlflow.tracking._tracking_service.utils._use_tracking_uri(uri):
            logged = mlflow.pytorch.load_model(f"models:/{output.model_id}")
        x = torch.randn(3, 64)
        final = load_model(result.checkpoint_dir, factory=FAULTY_MODEL)
        assert torch.equal(logged(x), final(x))

        # the tracking URI's password: in the job file the user wrote, nowhere else — not in
        # the console, the run's storage and checkpoints, or the MLflow store (names, params,
        # tags, artifacts)
        assert PLANTED not in err + capfd.readouterr().err
        written = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != "job.yaml"]
        assert written and not [p for p in written if PLANTED.encode() in p.read_bytes()]
        stores = list(tmp_path_factory.getbasetemp().glob("mlflow*/server.db*"))
        assert stores and not [p for p in stores if PLANTED.encode() in p.read_bytes()]
    finally:
        gate.close()


def test_a_resume_that_lengthens_a_cosine_run_goes_on_from_its_lr_with_the_whole_history(
    ray_local, tmp_path
):
    """A 4-step cosine run resumed with train.max_steps=8: the LR goes on from where it was
    (the end of the old decay: min_lr_ratio × peak) instead of jumping up the new curve; the
    console and a tag say so; the loss curve, FitResult.history and MLflow cover steps 1..8."""
    from rayacc.observe.events import ScheduleChanged

    def cfg(steps):
        return config(
            tmp_path,
            optim={"name": "sgd", "lr": 0.1, "schedule": "cosine", "min_lr_ratio": 0.1},
            train={"max_steps": steps},
            data={"source": "digits", "val_fraction": 0.1},
            run={"storage_path": str(tmp_path / "runs"), "name": "longer"},
        )

    seen: list = []

    class Events(RunObserver):
        def on_event(self, event):
            seen.append(event)

    first = fit_or_fail(cfg(4))
    from rayacc.driver.fit import fit

    longer = fit(cfg(8), resume=True, observers=[Events()])
    (change,) = [e for e in seen if isinstance(e, ScheduleChanged)]
    assert (change.step, change.old_length, change.new_length) == (4, 4, 8)
    assert "schedule re-planned at step 4" in change.console_line()
    assert [r["step"] for r in longer.history] == list(range(1, 9))

    # steps 1..4 as the checkpoint carries them: every rank's figures are the driver's
    # judgement, in MLflow and the first fit's records, not in the lineage
    def carried(record):
        return {k: v for k, v in record.items() if not k.startswith(("ranks/", "rank_"))}

    assert [carried(r) for r in longer.history[:4]] == [carried(r) for r in first.history]
    assert "ranks/slowest" in first.history[3] and "ranks/slowest" not in longer.history[3]
    lrs = [r["train/lr"] for r in longer.history]
    assert lrs[3] == pytest.approx(0.01) and lrs[4:] == pytest.approx([0.01] * 4), lrs
    client = MlflowClient(longer.tracking_uri)
    assert longer.mlflow_run_id == first.mlflow_run_id, "nothing was discarded: the same run"
    history = client.get_metric_history(longer.mlflow_run_id, "train/lr")
    assert sorted((m.step, m.value) for m in history) == list(enumerate(lrs, 1))
    tags = client.get_run(longer.mlflow_run_id).data.tags
    assert tags["rayacc.schedule_changes"] == change.describe()
    assert DISCARDED_TAG not in tags  # nothing after the checkpoint it resumed from
    assert steps_in(client, longer.mlflow_run_id, "val/loss") == [4, 8]


def test_a_run_whose_checkpoint_was_passed_over_resumes_again_and_again_at_other_sizes(
    ray_local, tmp_path, capfd, caplog
):
    """An FSDP run on 2 workers writes checkpoints 2 and 4; checkpoint 4 loses rank 1's part
    manifest (its shards stay, as when rank 1's node goes between its files and its manifest).
    A --resume on 1 worker passes it over (said), goes on from 2 and writes step 4 again in a
    folder of its own; two more resumes (1 worker, then 2) go on from the newest checkpoint:
    Ray Train's record of the run and rayacc's catalogue never disagree, and the lineage is
    steps 1..10 once each."""
    from rayacc.checkpoint import RunCheckpoints
    from rayacc.checkpoint.format import folder_name
    from rayacc.driver.ray_record import RECORD_FILE

    def cfg(workers, steps):
        return config(
            tmp_path,
            train={"strategy": "fsdp", "max_steps": steps, "checkpoint_every_steps": 2},
            scaling={"num_workers": workers, "cpus_per_worker": 0.5},
            run={"storage_path": str(tmp_path / "runs"), "name": "passed", "keep_checkpoints": 2},
            tracking={"enabled": False},
        )

    starts: list = []

    class Starts(RunObserver):
        def on_event(self, event):
            if isinstance(event, RunStarted):
                starts.append(event.resumed_from)

    fit_or_fail(cfg(2, 4))
    run = tmp_path / "runs" / "passed"
    (run / folder_name(4) / "parts" / "rank_00001.json").unlink()
    capfd.readouterr()
    for workers, steps in ((1, 6), (1, 8), (2, 10)):
        result = fit_or_fail(cfg(workers, steps), resume=True, observers=[Starts()])
        assert [r["step"] for r in result.history] == list(range(1, steps + 1))
        record = json.loads((run / RECORD_FILE).read_text())
        named = [r["checkpoint_dir_name"] for r in record["checkpoint_results"]]
        assert named and all((run / name / "meta.json").is_file() for name in named), named
    assert starts == [2, 6, 8], starts
    # the resume's notes: the header on the console, a log record where logging is captured
    err = capfd.readouterr().err + caplog.text
    assert f"passed over {run / folder_name(4)}" in err and "parts/rank_00001.json" in err, err
    kept = [c.name for c in RunCheckpoints(str(tmp_path / "runs"), "passed").list()]
    # retention (keep 2) counts the checkpoints a resume can take: the folder passed over
    # goes with the good ones before them
    assert kept == [folder_name(8), folder_name(10)], kept
    assert load_model(result.checkpoint_dir) is not None
