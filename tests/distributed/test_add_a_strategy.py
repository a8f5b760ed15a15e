"""Adding a strategy is one module and one matrix value (docs/design.md, "How to add …"): a
second DDP under another name, in a package of its own that registers it by entry point and
touches no file of rayacc, is taken by the schema, the planner and the engine (its matrix cases
ride the combination matrix's rank groups: `test_matrix.py`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.models import twin_strategy as twin

pytestmark = pytest.mark.distributed
JOB = Path(__file__).resolve().parents[2] / "jobs" / "digits.yaml"


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


def _broken_package(root):
    """A package that registers strategy `broken`, whose module fails to import."""
    (root / "rayacc_broken.py").write_text("raise ImportError('libfoo.so: cannot open')\n")
    info = root / "rayacc_broken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rayacc_broken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[rayacc.strategies]\nbroken = rayacc_broken:Wing\n")
    return root


def test_a_registered_wing_that_does_not_load_costs_only_the_runs_that_name_it(tmp_path):
    """Checkpoints are read back and the planner plans with the wings that load (the broken
    one warned of once, named); a run that names it is a user error naming it, exit 2."""
    code = (
        "import warnings, sys\n"
        "from rayacc.engine.parallel import state_format_named, strategy_classes\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    names = sorted(strategy_classes())\n"
        "    unknown = state_format_named(None)\n"
        "    whole = state_format_named('whole').name\n"
        "print(names, unknown, whole)\n"
        "print([str(w.message) for w in seen], file=sys.stderr)\n"
        "from rayacc.cli import main\n"
        f"print('exit', main(['train', '-c', '{JOB}', 'train.strategy=broken',\n"
        f"    'run.storage_path={tmp_path / 'runs'}', 'tracking.enabled=false']))\n"
    )
    out = _run(code, _broken_package(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "['ddp', 'deepspeed', 'fsdp'] None whole", out.stdout
    assert lines[-1] == "exit 2", out.stdout
    assert out.stderr.count("rayacc_broken:Wing") >= 2 and "libfoo.so" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
