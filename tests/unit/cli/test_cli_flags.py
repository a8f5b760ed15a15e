"""Every number a command's flags take is checked by one mechanism (typed argparse arguments)
before the command does any work; places a command will write or read are checked first too."""

from __future__ import annotations

import pytest

from tests.support import ROOT
from tests.support.services.cli import rayacc_here

JOB = str(ROOT / "jobs" / "digits.yaml")

BAD_FLAGS = [
    (["plan", "-c", JOB, "--search", "--budget-s", "-5"], "--budget-s", "> 0"),
    (["plan", "-c", JOB, "--search", "--budget-s", "0"], "--budget-s", "> 0"),
    (["plan", "-c", JOB, "--search", "--budget-s", "soon"], "--budget-s", "not a number"),
    (["plan", "-c", JOB, "--search", "--top", "0"], "--top", "≥ 1"),
    (["plan", "-c", JOB, "--search", "--top", "1.5"], "--top", "not a number"),
    (["sample", "run", "--tokens", "-1"], "--tokens", "≥ 0"),
    (["sample", "run", "--temperature", "-0.1"], "--temperature", "≥ 0"),
    (["sample", "run", "--top-k", "0"], "--top-k", "≥ 1"),
    (["sample", "run", "--seed", "x"], "--seed", "not a number"),
    (["data", "prepare", "shakespeare", "--seq-len", "0"], "--seq-len", "≥ 1"),
    (
        ["data", "prepare", "f.txt", "--out", "o", "--rows-per-group", "0"],
        "--rows-per-group",
        "≥ 1",
    ),
    (["data", "prepare", "f.txt", "--out", "o", "--rows-per-file", "-3"], "--rows-per-file", "≥ 1"),
]


@pytest.mark.parametrize(
    ("argv", "flag", "says"), BAD_FLAGS, ids=[f"{a[0]} {f} {a[-1]}" for a, f, _ in BAD_FLAGS]
)
def test_a_number_out_of_range_is_named_before_any_work(argv, flag, says, capsys, monkeypatch):
    ran = rayacc_here(argv, capsys, monkeypatch)
    assert ran.code == 2, ran
    assert f"argument {flag}" in ran.err and says in ran.err, ran.err
    assert "Traceback" not in ran.err


def test_a_plan_that_could_not_be_written_is_named_before_the_search(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = ["plan", "-c", JOB, "--search", "--out", str(blocker / "sub" / "PLAN.yaml")]
    ran = rayacc_here(argv, capsys, monkeypatch)
    assert ran.code == 2 and "--out" in ran.err and "Fix:" in ran.err, ran
    assert "rayacc plan --search" not in ran.out  # the search never began


def test_runs_of_a_storage_path_that_does_not_exist_is_a_mistake(tmp_path, capsys, monkeypatch):
    ran = rayacc_here(["runs", "--storage", str(tmp_path / "nope")], capsys, monkeypatch)
    assert ran.code == 2 and "no such folder" in ran.err and "Fix:" in ran.err, ran
    empty = tmp_path / "empty"
    empty.mkdir()
    ran = rayacc_here(["runs", "--storage", str(empty)], capsys, monkeypatch)
    assert ran.code == 0 and "no rayacc runs" in ran.out
