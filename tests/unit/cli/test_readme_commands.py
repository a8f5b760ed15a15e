"""Every `rayacc …` command the READMEs show parses as written (synopsis lines with [options]
or a|b alternatives are left out; they are not commands)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from rayacc.cli import REPORT_OUT, parse_args

ROOT = Path(__file__).resolve().parents[3]
READMES = [
    "README.md",
    "cluster/README.md",
    "bench/README.md",
    "docs/design.md",
    "docs/guide.md",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "bench" / "results").glob("*.md")),
]


def code_lines(text: str) -> list[str]:
    """Lines of fenced and indented code blocks, backslash continuations joined, and inline
    code spans, as shell text."""
    block, prose, fenced = [], [], False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        (block if fenced or line.startswith("    ") else prose).append(line.strip())
    out = "\n".join(block).replace("\\\n", " ").splitlines()
    spans = re.findall(r"`([^`]+)`", "\n".join(prose), flags=re.S)
    return out + [" ".join(span.split()) for span in spans]


def commands() -> list[tuple[str, str]]:
    found = []
    for name in READMES:
        for line in code_lines((ROOT / name).read_text()):
            line = re.sub(r"<[^>]*>", "PLACEHOLDER", line.split(" #")[0].strip())
            # environment assignments and the venv prefix come before the command
            line = re.sub(r"^(?:[A-Z_]+=\S+\s+)*(?:\.venv/bin/)?", "", line)
            if not line.startswith("rayacc "):
                continue
            if any(mark in line for mark in ("[", "|", "...", "…")) or len(line.split()) < 3:
                continue  # a synopsis or a mention, not a command
            line = line.replace("$", "")
            found.append((name, line))
    return found


def test_the_readmes_show_commands():
    shown = {line.split()[1] for _, line in commands()}
    assert {"train", "submit"} <= shown, shown


@pytest.mark.parametrize("where, line", commands(), ids=[line for _, line in commands()])
def test_every_command_shown_parses(where, line, tmp_path, monkeypatch):
    # the line as a reader runs it in the checkout, where its placeholders (JOB.yaml,
    # PLAN.yaml, CONFIG) are the reader's own files: the files a flag checks for exist
    for name in (ROOT / "jobs").iterdir():
        (tmp_path / "jobs").mkdir(exist_ok=True)
        (tmp_path / "jobs" / name.name).symlink_to(name)
    for token in shlex.split(line):
        if re.fullmatch(r"[A-Z][A-Z_]*(\.(yaml|yml|json))?", token):
            (tmp_path / token).write_text("")
    monkeypatch.chdir(tmp_path)
    try:
        args = parse_args(shlex.split(line)[1:])
    except SystemExit as exc:
        pytest.fail(f"{where}: `{line}` does not parse (exit {exc.code})")
    assert callable(args.func)


@pytest.mark.parametrize(
    "uri, hint",
    [
        (
            "http://127.0.0.1:5000",
            "open the UI: http://127.0.0.1:5000/#/experiments/7/runs/abc"
            "?workflowType=machine_learning",
        ),
        (
            "sqlite:////tmp/m.db",
            "open the UI: mlflow ui --backend-store-uri sqlite:////tmp/m.db --port 5000, then "
            "http://127.0.0.1:5000/#/experiments/7/runs/abc?workflowType=machine_learning",
        ),
    ],
)
def test_the_summary_says_how_to_open_the_ui(uri, hint):
    from rich.console import Console

    from rayacc.config import TrainConfig
    from rayacc.config.batch_split import BatchSplit
    from rayacc.driver.fit import FitResult
    from rayacc.observe.console import summary_lines

    cfg = TrainConfig.from_dict({"batch": {"global_batch_size": 8, "micro_batch_size": 4}})
    result = FitResult(
        checkpoint_dir="/tmp/ckpt",
        mlflow_run_id="abc",
        metrics={},
        split=BatchSplit(8, 4, 1, 2),
        effective_lr=1e-3,
        run_name="r",
        storage_path="/tmp",
        tracking_uri=uri,
        mlflow_experiment_id="7",
        wall_time_s=1.0,
    )
    console = Console(record=True, width=200)
    for line in summary_lines(cfg, result):
        console.print(line)
    text = console.export_text()
    assert hint in text
    assert uri.startswith("sqlite") or "--backend-store-uri" not in text
    # MLflow 3's UI routes in the fragment and reads its view from the fragment's query
    from urllib.parse import parse_qs, urlsplit

    run_page, charts = (part.split()[0] for part in text.split("http://127.0.0.1:5000/")[-2:])
    route, _, query = urlsplit(run_page).fragment.partition("?")
    assert route == "/experiments/7/runs/abc"
    assert parse_qs(query) == {"workflowType": ["machine_learning"]}
    # and the experiment's charts in its saved view, loss first
    route, _, query = urlsplit(charts).fragment.partition("?")
    assert route == "/experiments/7/runs"
    assert parse_qs(query) == {
        "workflowType": ["machine_learning"],
        "viewStateShareKey": ["rayacc-loss-first"],
        "compareRunsMode": ["CHART"],
    }


def test_what_rayacc_writes_into_a_checkout_is_git_ignored(tmp_path, monkeypatch):
    """`rayacc submit` uploads what git does not ignore: every default output under the working
    directory, taken from the code that writes it, is ignored."""
    import subprocess

    from rayacc.driver.runs import default_storage
    from rayacc.driver.sweep import _abs_storage
    from rayacc.tracking.mlflow_sink import default_tracking_uri

    monkeypatch.chdir(ROOT)
    db = default_tracking_uri().removeprefix("sqlite:///")
    outputs = [
        db,
        db + "-journal",
        db + "-wal",
        str(Path(default_storage()) / "run-1" / "checkpoint_step00000001" / "state.pt"),
        str(Path(_abs_storage(None)) / "sweep-1" / "trial_0" / "result.json"),
        str(ROOT / REPORT_OUT / "report.csv"),
        str(ROOT / "mlruns" / "0" / "meta.yaml"),
    ]
    for path in outputs:
        relative = str(Path(path).relative_to(ROOT))
        ignored = subprocess.run(["git", "check-ignore", "-q", relative], cwd=ROOT).returncode
        assert ignored == 0, f"{relative} is not git-ignored"
