"""What README and the guide show is what the code takes and prints: every YAML block validates
by the schema it is written for (a sweep file's or a job's), a block said to be a shipped file is
that file, and the progress line shown is the one the console prints for those figures."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from rayacc.config import TrainConfig
from rayacc.config.sweep import SweepConfig
from rayacc.observe.console import progress_line

ROOT = Path(__file__).resolve().parents[3]
DOCS = ["README.md", "docs/guide.md"]
SWEEP_KEYS = {"base", "grid", "hold", "random", "from_plan", "plan"}


def yaml_blocks() -> list[tuple[str, int, str]]:
    found = []
    for name in DOCS:
        text = (ROOT / name).read_text()
        for m in re.finditer(r"```yaml\n(.*?)```", text, flags=re.S):
            found.append((name, text[: m.start()].count("\n") + 1, m.group(1)))
    return found


def test_the_docs_show_yaml():
    assert len(yaml_blocks()) >= 2


@pytest.mark.parametrize(("doc", "line", "block"), yaml_blocks(), ids=lambda v: str(v)[:30])
def test_each_yaml_block_validates_by_its_schema(doc, line, block):
    data = yaml.safe_load(block)
    assert isinstance(data, dict), f"{doc}:{line}"
    if SWEEP_KEYS & set(data):
        SweepConfig.model_validate(data)
    else:
        TrainConfig.from_dict(data)


def test_a_block_said_to_be_a_shipped_file_is_that_file():
    text = (ROOT / "README.md").read_text()
    said = re.findall(r"\(`(jobs/[\w.]+\.yaml)`, as shipped\):\n```yaml\n(.*?)```", text, re.S)
    assert said
    for path, block in said:
        assert block == (ROOT / path).read_text(), path


def test_the_progress_line_shown_is_the_consoles():
    record = {
        "step": 100,
        "train/loss": 2.1043,
        "train/lr": 0.000854,
        "train/samples_per_s": 78.0,
        "perf/tokens_per_s": 9982.0,
        "val/loss": 2.0957,
    }
    line = progress_line(record, 300, 62.0, 125.0)
    assert line in (ROOT / "README.md").read_text(), line
