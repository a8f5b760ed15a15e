"""The Python floor the project declares is the one its code runs on: `requires-python`, the
README and ruff's target say the same version, and no file uses a language feature or a
standard-library name newer than it (vermin reads every file; a file added tomorrow is read
the day it lands)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.support import ROOT

VERMIN = Path(sys.executable).with_name("vermin")
CODE = ["rayacc", "jobs", "bench", "tests"]


def floor() -> tuple[int, int]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    spec = project["project"]["requires-python"]
    found = re.fullmatch(r">=\s*3\.(\d+)", spec)
    assert found, f"requires-python {spec!r}: write it as >=3.N"
    return 3, int(found[1])


def vermin(*paths: str | Path) -> subprocess.CompletedProcess:
    major, minor = floor()
    return subprocess.run(
        [
            VERMIN,
            f"-t={major}.{minor}-",
            "--violations",
            "--no-tips",
            "--eval-annotations",
            "--no-parse-comments",
            *map(str, paths),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_readme_and_ruff_declare_the_floor_of_pyproject():
    major, minor = floor()
    assert f"Python ≥ {major}.{minor};" in (ROOT / "README.md").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["ruff"]["target-version"] == f"py{major}{minor}"
    assert sys.version_info[:2] >= (major, minor)


def test_no_file_needs_a_python_above_the_floor():
    ran = vermin(*CODE)
    assert ran.returncode == 0, ran.stdout + ran.stderr


def test_the_check_fails_on_a_feature_above_the_floor(tmp_path):
    major, minor = floor()
    # a type alias statement is 3.12 syntax; the standard library's `datetime.UTC` is 3.11
    newer = {
        (3, 11): "type Steps = list[int]\n",
        (3, 10): "import datetime\nnow = datetime.datetime.now(datetime.UTC)\n",
    }[(major, minor)]
    (tmp_path / "newer.py").write_text(newer)
    ran = vermin(tmp_path)
    assert ran.returncode != 0 and "newer.py" in ran.stdout, ran.stdout
