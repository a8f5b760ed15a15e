"""User mistakes exit 2 with a message naming the field or file and the fix, and no traceback,
before Ray starts. The checks run `rayacc.cli.main` in this process (a `rayacc` process costs
seconds of imports each); one runs the real command to prove its exit status."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support.services.cli import Ran, rayacc_here, rayacc_process

ROOT = Path(__file__).resolve().parents[3]
DIGITS_JOB = str(ROOT / "jobs" / "digits.yaml")


@pytest.fixture
def rayacc(capsys, monkeypatch, cache):
    def run(*argv: str) -> Ran:
        return rayacc_here(list(argv), capsys, monkeypatch, RAYACC_CACHE=str(cache), RAY_ADDRESS="")

    return run


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cli-cache")


def bad_parquet(tmp_path: Path) -> str:
    path = tmp_path / "wrong_columns.parquet"
    pq.write_table(pa.table({"pixels": [[0.0, 1.0]], "y": [1]}), path)
    return str(path)


CASES = [
    (
        lambda tmp: ["train", "-c", str(tmp / "missing.yaml")],
        ["argument -c/--config: no such file", "missing.yaml"],
    ),
    (
        lambda tmp: ["train", "-c", DIGITS_JOB, f"data.source={bad_parquet(tmp)}"],
        ["wrong_columns.parquet", "match no format", "`features`", "`tokens`"],
    ),
    (
        lambda tmp: ["train", "-c", DIGITS_JOB, "data.source=/nowhere/data.parquet"],
        ["/nowhere/data.parquet", "no such file"],
    ),
    (
        lambda tmp: ["train", "-c", DIGITS_JOB, "batch.micro_batch_size=30"],
        ["batch.micro_batch_size", "does not divide", "Fix: set batch.micro_batch_size to"],
    ),
    (
        lambda tmp: ["train", "-c", DIGITS_JOB, "model.name=transformer"],
        ["model.name", "'mlp', 'gpt', 'factory' or 'hf'"],
    ),
    (
        lambda tmp: [
            "train",
            "-c",
            DIGITS_JOB,
            "model.name=factory",
            "model.factory=nosuchpkg.models:build",
        ],
        ["model.factory", "cannot import 'nosuchpkg.models'"],
    ),
    (
        lambda tmp: ["train", "-c", DIGITS_JOB, "model.name=gpt"],
        ["model.name=gpt needs token data", "Fix: use model.name=mlp"],
    ),
    (
        lambda tmp: ["train", "-c", DIGITS_JOB, "optim.lr_scalling=sqrt"],
        ["optim.lr_scalling: unknown key", "did you mean 'optim.lr_scaling'"],
    ),
    (
        # a mistyped store is named, not created empty and searched
        lambda tmp: ["report", "some-run", "--tracking-uri", f"sqlite:///{tmp / 'typo.db'}"],
        ["typo.db", "no tracking store there"],
    ),
    # `rayacc jobs`: the arguments are checked before any cluster is asked
    (lambda tmp: ["jobs", "stop"], ["`rayacc jobs stop` needs a job id", "Fix:"]),
    (lambda tmp: ["jobs", "list", "raysubmit_1"], ["takes no job id", "Fix: drop it"]),
    (lambda tmp: ["jobs", "status", "raysubmit_1", "--follow"], ["--follow streams logs only"]),
]


@pytest.mark.parametrize(
    ("argv", "expected"),
    CASES,
    ids=[
        "missing-file",
        "wrong-columns",
        "missing-parquet",
        "indivisible-batch",
        "unknown-model",
        "factory-import",
        "model-data-mismatch",
        "unknown-key",
        "report-store-typo",
        "jobs-without-id",
        "jobs-list-with-id",
        "jobs-follow-not-logs",
    ],
)
def test_user_errors_exit_2_with_message(tmp_path, rayacc, argv, expected):
    ran = rayacc(*argv(tmp_path))
    assert ran.code == 2, ran.err
    for text in expected:
        assert text in ran.err, ran.err
    assert "Traceback" not in ran.err
    assert "Ray" not in ran.err + ran.out, "the error must come before Ray starts"
    assert not list(tmp_path.glob("*.db")), "a mistake left a store behind"


def test_the_command_itself_exits_2_on_a_user_error(tmp_path, cache):
    proc = rayacc_process(
        ["train", "-c", DIGITS_JOB, "batch.micro_batch_size=30"],
        RAYACC_CACHE=str(cache),
        RAY_ADDRESS="",
    )
    assert proc.returncode == 2, proc.stderr
    assert "batch.micro_batch_size" in proc.stderr and "Traceback" not in proc.stderr


def test_plan_prints_the_resolved_batch(rayacc):
    proc = rayacc("plan", "-c", DIGITS_JOB, "scaling.num_workers=4")
    assert proc.code == 0, proc.err
    assert "global batch 256 = micro 32 × accum 2 × workers 4" in proc.out
    assert "effective LR 0.006 = 0.003 × linear(256/128)" in proc.out


def test_plan_lists_memory_per_rank_for_each_strategy(rayacc):
    proc = rayacc("plan", "-c", DIGITS_JOB, "--memory", "scaling.num_workers=4")
    assert proc.code == 0, proc.err
    assert "26,122 parameters, fp32, 4 workers" in proc.out, proc.out
    rows = {
        line.split("  ")[1].strip(): [float(v) for v in line.split()[-4:]]
        for line in proc.out.splitlines()
        if line.startswith("  ddp") or line.startswith("  fsdp")
    }
    ddp, every, end = rows["ddp"], rows["fsdp every_micro_step"], rows["fsdp window_end"]
    # AdamW: two slots; fsdp holds a quarter of each at 4 workers, window_end whole gradients
    assert ddp[2] == pytest.approx(2 * ddp[0], abs=0.1)
    assert every[:3] == pytest.approx([d / 4 for d in ddp[:3]], abs=0.1)
    assert end[1] == ddp[1] and ddp[3] == every[3] > 0


def test_data_prepare(rayacc, cache):
    proc = rayacc("data", "prepare", "digits")
    assert proc.code == 0, proc.err
    assert "digits: 1797 rows (classification)" in proc.out
    assert (cache / "digits" / "digits.parquet").is_file()


def test_plan_gives_a_pipelines_memory(rayacc):
    """`plan --memory` counts a pipeline's fullest rank and the micro-batches its schedule
    holds."""
    job = str(Path(DIGITS_JOB).with_name("shakespeare.yaml"))
    pp = ("train.strategy=fsdp", "train.pipeline_parallel=2", "scaling.num_workers=4")
    proc = rayacc("plan", "-c", job, *pp, "--memory")
    assert proc.code == 0, proc.err
    assert "4 workers in pipelines of 2 stages: the fullest rank 52% of the model" in proc.out
    assert "activations of 2 micro-batches of 8 (the schedule's in flight)" in proc.out
    assert "  fsdp × pp 2 " in proc.out, proc.out


def test_plan_lists_the_worker_counts_of_an_elastic_run(rayacc):
    proc = rayacc("plan", "-c", DIGITS_JOB, "scaling.num_workers=[1,4]")
    assert proc.code == 0, proc.err
    assert "elastic run [1, 4] (keep_global_batch)" in proc.out
    assert "1 → micro 32 × accum 8, global 256" in proc.out
    # 3 workers keep it in uneven shares: every size of the range runs
    assert "3 → shares 86+85+85, micro 32 × accum 3, global 256; 4 →" in proc.out
    assert "Not at" not in proc.out


YAML_DAMAGE = {
    "not text": b"\xff\xfe\x00\x80 binary",
    "not YAML": b"batch: [1, 2\n",
    "empty": b"",
    "another shape": b"- 1\n- 2\n",
}
"""Ways a YAML file a command reads comes back wrong."""

READS_YAML = {
    "train -c": lambda f: ["train", "-c", f],
    "plan -c": lambda f: ["plan", "-c", f],
    "verify -c": lambda f: ["verify", "-c", f],
    "sweep -c": lambda f: ["sweep", "-c", f],
    "train --plan": lambda f: ["train", "-c", DIGITS_JOB, "--plan", f],
}


@pytest.mark.parametrize("how", YAML_DAMAGE)
@pytest.mark.parametrize("command", READS_YAML)
def test_a_yaml_file_that_is_not_a_config_is_named_with_the_fix(tmp_path, rayacc, command, how):
    """Every command that reads a YAML file (a job, a sweep, a plan): a file that is binary, not
    YAML, empty or another shape is exit 2 naming it with the fix, never a traceback."""
    path = tmp_path / "given.yaml"
    path.write_bytes(YAML_DAMAGE[how])
    ran = rayacc(*READS_YAML[command](str(path)))
    assert ran.code == 2, ran.out + ran.err
    assert "given.yaml" in ran.err and "Fix:" in ran.err, ran.err
    assert "Traceback" not in ran.err, ran.err


def test_version_is_the_packages(rayacc):
    import tomllib

    ran = rayacc("--version")
    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert ran.code == 0 and ran.out.strip() == f"rayacc {want}", ran


def test_runs_never_cuts_a_name_or_an_mlflow_id_on_a_narrow_terminal(monkeypatch, tmp_path):
    """`rayacc runs` lists what `--resume run.name=NAME` takes: rich cut it to `rayacc-2026…`
    on a terminal of 80 columns."""
    import argparse

    from rich.console import Console

    import rayacc.cli.runs as cli_runs
    import rayacc.driver.runs as driver_runs
    from rayacc.driver.runs import RunSummary

    name = "rayacc-20261205-123412-3f810c-a-rather-long-run-name"
    run_id = "244996ae564348849bd88da9212271cd"
    summary = RunSummary(
        name=name, job="digits", model="mlp", data="digits", steps_done=60, total_steps=60,
        last_checkpoint=str(tmp_path / "checkpoint_step00000060"), mlflow_run_id=run_id,
        status="finished", started="2026-12-05", identity=None, kind="verify",
    )  # fmt: skip
    console = Console(record=True, width=80, force_terminal=False)
    monkeypatch.setattr(cli_runs, "_console", lambda: console)
    monkeypatch.setattr(driver_runs, "list_runs", lambda storage: [summary])
    monkeypatch.setattr(driver_runs, "storage_exists", lambda storage: True)
    assert cli_runs.cmd_runs(argparse.Namespace(storage=str(tmp_path))) == 0
    text = console.export_text()
    assert name in text and run_id in text, text
    assert "finished (verify run)" in text, "a verify probe is shown as one"


def test_a_runs_source_in_mlflow_is_the_command_that_started_it(tmp_path, capsys, monkeypatch):
    """MLflow's `mlflow.source.name` of a `rayacc train` run: the command as typed (the sink
    masks it, as every tag)."""
    import rayacc.driver.fit as driver_fit

    seen: dict = {}

    def fit(cfg, **kwargs):
        seen.update(kwargs)
        raise driver_fit.TrainingError("stopped before Ray")

    monkeypatch.setattr(driver_fit, "fit", fit)
    monkeypatch.setattr(driver_fit, "ensure_ray", lambda *args, **kwargs: None)
    job = str(Path(__file__).resolve().parents[3] / "jobs" / "digits.yaml")
    argv = ["train", "-c", job, f"run.storage_path={tmp_path / 'runs'}", "train.max_steps=2"]
    monkeypatch.setattr(sys, "argv", ["/somewhere/bin/rayacc", *argv])
    ran = rayacc_here(argv, capsys, monkeypatch)
    assert ran.code == 1 and "stopped before Ray" in ran.err
    assert seen["tags"] == {"mlflow.source.name": shlex.join(["rayacc", *argv])}
