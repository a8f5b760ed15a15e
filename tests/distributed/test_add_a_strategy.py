"""Adding a strategy is one module and one matrix value (docs/design.md, "How to add …"): a
second DDP under another name, in a package of its own that registers it by entry point and
touches no file of rayacc, is taken by the schema, the planner and the engine (its matrix cases
ride the combination matrix's rank groups: `test_matrix.py`)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.models import twin_strategy as twin

pytestmark = pytest.mark.distributed


def _run(code: str, *paths) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": ":".join(map(str, paths)), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


def test_the_schema_the_planner_and_the_engine_take_it(tmp_path):
    code = (
        "from rayacc.config import TrainConfig\n"
        "from rayacc.engine.parallel import strategy_class\n"
        "from rayacc.planner.candidates import enumerate_candidates\n"
        f"cfg = TrainConfig.model_validate({{'train': {{'strategy': '{twin.NAME}'}}}})\n"
        "cls = strategy_class(cfg.train.strategy)\n"
        "plans = {c.strategy for c in enumerate_candidates(8, [2], 0)[0]}\n"
        f"print(f'{{cls.__module__}}:{{cls.__qualname__}}', '{twin.NAME}' in plans)\n"
    )
    out = _run(code, twin.write_package(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [twin.CLASS, "True"]


def test_without_the_package_the_name_is_refused_naming_the_registered_ones():
    from rayacc.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match="train.strategy") as err:
        TrainConfig.from_dict({"train": {"strategy": twin.NAME}})
    assert "'ddp', 'fsdp' or 'deepspeed'" in str(err.value)


def test_a_package_that_takes_a_built_in_name_is_warned_of_and_left_out(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    shadow = twin.write_package(tmp_path / "a", entry="ddp", dist="rayacc_shadow")
    code = (
        "from rayacc.engine.parallel import strategy_class\n"
        f"print(strategy_class('ddp').__module__, strategy_class('{twin.NAME}').__module__)\n"
    )
    out = _run(code, shadow, twin.write_package(tmp_path / "b"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["rayacc.engine.parallel.ddp", "rayacc_twin"]
    assert "takes the name of the strategy 'ddp'" in out.stderr
