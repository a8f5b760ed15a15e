"""Adding a strategy is one module and one matrix value (docs/design.md, "How to add a
strategy"): a second DDP under another name, in a package of its own that registers it by entry
point and touches no file of rayacc, is taken by the schema, built by `build_rank` and passes
the pairwise combination matrix against the single-process full-batch steps on gloo ranks."""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
import textwrap

import pytest

from tests.distributed.test_matrix import BF16_BOUND, FP32_BOUND
from tests.support.ranks import matrix as M
from tests.support.ranks.engine_helpers import spawn_ranks, update_rel_err

pytestmark = pytest.mark.distributed

NAME = "twin"
WING = '''
"""A second DDP under another name."""

from rayacc.engine.parallel.ddp import DDP


class Twin(DDP):
    name = "twin"
'''


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The package on sys.path (spawned ranks inherit it), found through its dist-info."""
    root = tmp_path_factory.mktemp("plugin")
    (root / "rayacc_twin").mkdir()
    (root / "rayacc_twin" / "__init__.py").write_text(WING)
    info = root / "rayacc_twin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rayacc-twin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[rayacc.strategies]\n{NAME} = rayacc_twin:Twin\n")
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))


def test_the_registry_the_schema_and_the_planner_take_it(plugin):
    code = textwrap.dedent(
        f"""
        from rayacc.config import TrainConfig
        from rayacc.engine.parallel import strategy_class
        from rayacc.planner.candidates import enumerate_candidates
        from rayacc.run.quantities import memory_per_rank

        cfg = TrainConfig.model_validate({{"train": {{"strategy": "{NAME}"}}}})
        cls = strategy_class(cfg.train.strategy)
        plans = {{c.strategy for c in enumerate_candidates(8, [2], 0)[0]}}
        print(cls.__module__, "{NAME}" in plans)
        """
    )
    env = {"PYTHONPATH": str(plugin), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["rayacc_twin", "True"]


def test_without_the_package_the_name_is_refused_naming_the_registered_ones():
    from rayacc.config import ConfigError, TrainConfig

    with pytest.raises(ConfigError, match="train.strategy") as err:
        TrainConfig.from_dict({"train": {"strategy": NAME}})
    assert "'ddp', 'fsdp' or 'deepspeed'" in str(err.value)


def test_it_passes_the_combination_matrix(plugin, tmp_path):
    factors = {**M.FACTORS, "strategy": (*M.FACTORS["strategy"], NAME)}
    chosen = [c for c in M.cases(factors) if c.strategy == NAME]
    assert {c.workers for c in chosen} == set(M.FACTORS["workers"])  # its pairs, every size
    finals = {}
    for phase, world, group in M.phase_groups(chosen):
        folder = tmp_path / f"{phase}{world}"
        folder.mkdir()
        indices = [c.index for c in group]
        target = functools.partial(M.run_group, phase=phase, indices=indices, factors=factors)
        ranks = spawn_ranks(target, world, folder, f"{NAME} matrix phase {phase} on {world}")
        assert "error" not in ranks[0], ranks[0].get("error")
        finals.update({i: v for i, v in ranks[0].items() if isinstance(i, int)})
    failures = []
    for case in chosen:
        got = finals[case.index]
        assert got["strategy"] == "rayacc_twin:Twin", got["strategy"]
        # the yardstick is strategy-free: one process, whole windows, float32
        before, after = M.reference(dataclasses.replace(case, strategy=M.FACTORS["strategy"][0]))
        err = update_rel_err(before, got["params"], after)
        if not err <= (BF16_BOUND if case.precision == "bf16" else FP32_BOUND):
            failures.append(f"{err:.2e} {case.label()}")
    assert not failures, failures


def test_a_package_that_takes_a_built_in_name_is_warned_of_and_left_out(plugin, tmp_path):
    info = tmp_path / "rayacc_shadow-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rayacc-shadow\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[rayacc.strategies]\nddp = rayacc_twin:Twin\n")
    code = (
        "from rayacc.engine.parallel import strategy_class\n"
        "print(strategy_class('ddp').__module__, strategy_class('twin').__module__)\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}:{plugin}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["rayacc.engine.parallel.ddp", "rayacc_twin"]
    assert "takes the name of the strategy 'ddp'" in out.stderr
