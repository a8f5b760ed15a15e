"""End to end on a real multi-node Ray cluster on loopback (cluster/local.sh): a head, one worker
node and an MLflow server; `rayacc submit --follow` runs jobs/digits.yaml with one training worker
on each node. A secret is planted in the tracking URI (`user:password@`, which the server takes as
basic auth) and searched for in everything the run leaves: the console and the job's logs, the
job's record on the cluster, the run's storage, the MLflow store, the cluster's own logs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.support.services.cli import rayacc_process
from tests.support.services.counts import count

pytestmark = [pytest.mark.ray, pytest.mark.cluster]
ROOT = Path(__file__).resolve().parents[2]
PORT = 27379
SECRET = "PlantedS3cret-4e1b"
JOB_RECORDS = (
    "import os; from ray.job_submission import JobSubmissionClient as C; "
    "jobs = C(os.environ['RAY_ADDRESS']).list_jobs(); "
    "print([(j.entrypoint, j.metadata, j.message) for j in jobs])"
)


def read_env(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value
    return env


def pids_of(state: Path) -> list[int]:
    # a record is "pid start-time boot-id"
    return [int(p.read_text().split()[0]) for p in state.glob("*.pid")]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie has exited: only its parent has not collected it yet
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def test_submit_to_local_multinode_cluster(tmp_path):
    state = tmp_path / "cluster"
    # a user's first cluster: a home where Ray never ran (no token for its authentication yet)
    home = tmp_path / "home"
    env = dict(
        os.environ,
        HOME=str(home),
        RAYACC_LOCAL_DIR=str(state),
        RAYACC_LOCAL_PORT=str(PORT),
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(name, None)
    count("clusters")
    count("MLflow servers")
    up = subprocess.run(
        ["bash", "cluster/local.sh", "up", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    started = pids_of(state)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert (home / ".ray" / "auth_token").stat().st_size > 0
        cluster = read_env(state / "env")
        job_env = dict(env, **cluster)
        tracking = cluster["MLFLOW_TRACKING_URI"].replace("http://", f"http://alice:{SECRET}@")
        submit = rayacc_process(
            [
                "submit",
                "jobs/digits.yaml",
                "train.epochs=2",
                "scaling.placement_strategy=STRICT_SPREAD",
                f"tracking.tracking_uri={tracking}",
                "tracking.experiment=e2e",
                f"run.storage_path={tmp_path / 'runs'}",
                "--address",
                cluster["RAY_ADDRESS"],
                "--follow",
            ],
            timeout=900,
            **job_env,
        )
        assert submit.returncode == 0, submit.stdout[-4000:] + submit.stderr[-4000:]
        assert "SUCCEEDED" in submit.stdout
        assert "tracking off" not in submit.stdout + submit.stderr
        # MLflow's own run links stay off the job's output (the summary says where the run is)
        assert "View run" not in submit.stdout and "View experiment" not in submit.stdout

        client = MlflowClient(cluster["MLFLOW_TRACKING_URI"])
        (run,) = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
        p = run.data.params
        assert (
            p["micro_batch_size"],
            p["grad_accum_steps"],
            p["num_workers"],
            p["global_batch_size"],
        ) == ("32", "4", "2", "256")
        assert float(p["effective_lr"]) == pytest.approx(0.006)
        nodes = run.data.tags["rayacc.worker_nodes"].split(",")
        assert len(nodes) == 2 and len(set(nodes)) == 2, f"workers ran on {nodes}"
        steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
        assert sorted(steps) == list(range(1, 13))

        # the planted secret is nowhere: console, job record, storage, MLflow, cluster logs
        # the cluster's record of the job (entrypoint, metadata, message), as the Jobs API
        # gives it to anyone who asks
        records = subprocess.run(
            [sys.executable, "-c", JOB_RECORDS],
            cwd=ROOT,
            env=job_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert records.returncode == 0 and "rayacc.cli" in records.stdout, records.stderr[-2000:]
        listed = rayacc_process(
            ["jobs", "list", "--address", cluster["RAY_ADDRESS"]], timeout=120, **job_env
        )
        # a finished job's logs, without --follow: whole (they begin with Ray's own record,
        # which the console once dropped with everything after it)
        job_id = re.search(r"rayacc jobs logs (\S+)", submit.stdout).group(1)
        logs = rayacc_process(
            ["jobs", "logs", job_id, "--address", cluster["RAY_ADDRESS"]], timeout=120, **job_env
        )
        assert logs.returncode == 0 and "Running entrypoint for job" in logs.stdout, logs.stdout
        assert "rayacc" in logs.stdout and SECRET not in logs.stdout
        # a job id the cluster does not know: named, exit 2, no traceback
        unknown = rayacc_process(
            ["jobs", "status", "raysubmit_nosuchjob", "--address", cluster["RAY_ADDRESS"]],
            timeout=120,
            **job_env,
        )
        assert unknown.returncode == 2, unknown.stdout + unknown.stderr
        assert "raysubmit_nosuchjob" in unknown.stderr and "Traceback" not in unknown.stderr
        outputs = {
            "console": submit.stdout + submit.stderr,
            "rayacc jobs list": listed.stdout + listed.stderr,
            "job records": records.stdout,
        }
        for folder in (tmp_path / "runs", state, Path(f"/tmp/rayacc-local-{PORT}")):
            for path in folder.rglob("*"):
                # the uploaded project is the project's source (this test's included)
                if "working_dir_files" in path.parts or not path.is_file() or path.is_symlink():
                    continue
                outputs[str(path)] = path.read_bytes().decode(errors="replace")
        found = {where: text for where, text in outputs.items() if SECRET in text}
        # Ray's runtime-env agent logs each job's runtime_env, environment included, on every
        # node (INFO, runtime_env_agent.log): the one place the job's environment — where
        # `rayacc submit` puts an override with a credential — is written; README says so
        ray_logged = {
            where
            for where, text in found.items()
            if Path(where).name.startswith("runtime_env_agent")
            and all("RAYACC_OVERRIDES" in line for line in text.splitlines() if SECRET in line)
        }
        assert not set(found) - ray_logged, f"the planted secret is in {set(found) - ray_logged}"
        leaked_user = [w for w, text in outputs.items() if "alice:" in text and w not in ray_logged]
        assert not leaked_user, leaked_user
        assert len(outputs) > 20, "the search looked at too little to prove anything"
    finally:
        down = subprocess.run(
            ["bash", "cluster/local.sh", "down"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert down.returncode == 0, down.stderr
    assert len(started) == 3, started  # head, worker node, MLflow server
    assert not [pid for pid in started if alive(pid)], "local.sh down left processes running"
