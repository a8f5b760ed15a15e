"""`rayacc submit` and `rayacc jobs`: the Ray Jobs SDK with the project as working_dir."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from rayacc import env
from rayacc.config import TrainConfig
from rayacc.redact import contains_secret, redact

__all__ = [
    "MAX_UPLOAD_BYTES",
    "SECRET_OVERRIDES",
    "SubmitError",
    "project_root",
    "submit",
    "upload_size",
]

SECRET_OVERRIDES = env.OVERRIDES
"""Environment variable (a JSON list) of overrides `rayacc train` adds to its command line's:
how a submitted job receives the ones that carry credentials."""

MAX_UPLOAD_BYTES = 100 * 1024**2
"""Largest working_dir rayacc uploads; Ray keeps it in the GCS of the head node."""

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


class SubmitError(ValueError):
    pass


def project_root(start: Path) -> Path:
    for folder in (start.resolve(), *start.resolve().parents):
        if (folder / "pyproject.toml").is_file() and (folder / "rayacc").is_dir():
            return folder
    raise SubmitError(
        f"no rayacc project (pyproject.toml beside rayacc/) at or above {start}. "
        "Fix: run `rayacc submit` inside the project"
    )


def upload_files(root: Path) -> list[Path]:
    """The files Ray uploads as working_dir: .gitignore'd ones stay behind (as Ray does)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            check=True,
        )
        return [root / p for p in out.stdout.decode().split("\0") if p and (root / p).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in root.rglob("*") if p.is_file() and ".git" not in p.parts]


def upload_size(root: Path) -> int:
    return sum(p.stat().st_size for p in upload_files(root))


def _client(address: str | None):
    import os

    from ray.job_submission import JobSubmissionClient

    from rayacc.driver.arguments import address_problem

    given = address or os.environ.get("RAY_ADDRESS")
    if given and (problem := address_problem(given)):
        source = "--address" if address else "$RAY_ADDRESS"
        raise SubmitError(f"{source}: {redact(problem)}")

    try:
        return JobSubmissionClient(address)
    except Exception as exc:
        raise SubmitError(
            f"cannot reach the Ray Jobs API at {redact(address or '$RAY_ADDRESS')}: "
            f"{redact(str(exc))}. Fix: pass "
            "--address http://HOST:8265 (through an SSH tunnel for cloud clusters), start the "
            "cluster with `ray[default]`, and set RAY_AUTH_MODE=token when the cluster uses "
            "token authentication"
        ) from None


def job_command(
    rel: Path, overrides: list[str], resume: bool = False
) -> tuple[str, dict[str, str]]:
    """The job's entrypoint and environment: `rayacc train` on the cluster (`--resume`: its
    resume, the one rule of driver/resume.py). An override that carries a credential travels
    in the environment (`SECRET_OVERRIDES`), never in the entrypoint, which the cluster stores
    and `rayacc jobs list` shows."""
    secret = [o for o in overrides if contains_secret(o)]
    env_vars = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    if secret:
        env_vars[SECRET_OVERRIDES] = json.dumps(secret)
    # `python -m` imports rayacc from the uploaded folder, not a copy installed on the node
    entrypoint = " ".join(
        [
            "python",
            "-m",
            "rayacc.cli",
            "train",
            "-c",
            shlex.quote(str(rel)),
            *(shlex.quote(o) for o in overrides if o not in secret),
            *(["--resume"] if resume else []),
        ]
    )
    return entrypoint, env_vars


def submit(
    job_file: str, overrides: list[str], address: str | None, follow: bool, resume: bool = False
) -> int:
    job_path = Path(job_file)
    from rayacc.driver.prelaunch import check
    from rayacc.driver.resume import resumed_overrides, started_overrides

    # user mistakes stop here, before any upload; a resume's run, where this machine reads
    # its folder, with the overrides it was started with beneath these
    checked = overrides
    started = started_overrides(job_file, overrides) if resume else None
    if started:
        checked = resumed_overrides(started, overrides).overrides
    check(TrainConfig.from_yaml(job_path, checked), "submit")
    root = project_root(Path.cwd())
    try:
        rel = job_path.resolve().relative_to(root)
    except ValueError:
        raise SubmitError(
            f"{job_file} is outside the project {root}; the job runs in the "
            "uploaded project folder. Fix: put the job spec under jobs/"
        ) from None
    size = upload_size(root)
    if size > MAX_UPLOAD_BYTES:
        raise SubmitError(
            f"the project folder {root} would upload {size / 2**20:.0f} MiB (limit "
            f"{MAX_UPLOAD_BYTES / 2**20:.0f} MiB). Fix: add large files (data, checkpoints, "
            "virtual environments) to .gitignore, and read data from a Parquet URI instead"
        )
    entrypoint, env_vars = job_command(rel, overrides, resume)
    client = _client(address)
    job_id = client.submit_job(
        entrypoint=entrypoint,
        runtime_env={"working_dir": str(root), "env_vars": env_vars},
        metadata={"rayacc.job_spec": str(rel)},
    )
    where = f" --address {redact(address)}" if address else ""
    print(f"submitted {job_id}: {entrypoint}")
    if SECRET_OVERRIDES in env_vars:
        print(
            "  overrides with credentials are passed in the job's environment, not its "
            "entrypoint; Ray's runtime-env agent logs a job's environment on the nodes "
            "(runtime_env_agent.log): on a shared cluster give credentials through the "
            "cluster's own environment instead (e.g. MLFLOW_TRACKING_USERNAME/PASSWORD)"
        )
    print(f"  follow it: rayacc jobs logs {job_id}{where} --follow")
    if not follow:
        return 0
    return follow_logs(client, job_id)


def show(logs: str) -> None:
    """A job's logs on stdout as they are: they begin with Ray's own records (its job
    manager's), which the console drops from rayacc's own output, so the whole text would go
    with them."""
    getattr(sys.stdout, "write_data", sys.stdout.write)(logs)


def follow_logs(client, job_id: str) -> int:
    import asyncio

    async def tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            show(chunk)
            sys.stdout.flush()

    asyncio.run(tail())
    status = str(client.get_job_status(job_id))
    while status.split(".")[-1] not in TERMINAL:
        time.sleep(1)
        status = str(client.get_job_status(job_id))
    status = status.split(".")[-1]
    print(f"job {job_id}: {status}")
    return 0 if status == "SUCCEEDED" else 1


def jobs_command(action: str, job_id: str | None, address: str | None, follow: bool) -> int:
    # the arguments first: a mistake is named before the cluster is asked anything
    if action != "list" and not job_id:
        raise SubmitError(
            f"`rayacc jobs {action}` needs a job id. Fix: rayacc jobs {action} JOB_ID (ids: "
            "`rayacc jobs list`)"
        )
    if action == "list" and job_id:
        raise SubmitError(f"`rayacc jobs list` takes no job id (got {job_id!r}). Fix: drop it")
    if follow and action != "logs":
        raise SubmitError(f"--follow streams logs only. Fix: rayacc jobs logs {job_id} --follow")
    client = _client(address)
    if action == "list":
        for job in client.list_jobs():
            print(f"{job.submission_id}\t{str(job.status).split('.')[-1]}\t{job.entrypoint}")
        return 0
    try:
        if action == "status":
            print(str(client.get_job_status(job_id)).split(".")[-1])
            return 0
        if action == "logs":
            if follow:
                return follow_logs(client, job_id)
            show(client.get_job_logs(job_id))
            return 0
        stopped = client.stop_job(job_id)
    except RuntimeError as exc:  # the Jobs API's reply to an unknown id (HTTP 404)
        raise SubmitError(
            f"job {job_id!r}: {redact(str(exc)).strip()} Fix: pass an id that "
            "`rayacc jobs list` shows"
        ) from None
    print(f"job {job_id}: {'stop requested' if stopped else 'already finished'}")
    return 0
