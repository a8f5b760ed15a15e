"""A parallel strategy is one wing (engine/parallel/<name>*.py) and one registry entry
(config/strategies.py): its name is a literal nowhere else, and every part of the product that
differs by strategy asks the wing."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rayacc
from rayacc.config.strategies import strategies, strategy_entry, strategy_sections
from rayacc.engine.parallel import Strategy, strategy_class, strategy_classes
from rayacc.engine.parallel.base import CostShape

ROOT = Path(rayacc.__file__).parent
REGISTRY = Path("config/strategies.py")


def _in_wing(rel: Path, name: str) -> bool:
    return rel.parent == Path("engine/parallel") and (
        rel.stem == name or rel.stem.startswith(f"{name}_")
    )


def stray_literals(sources: dict[Path, str], names: set[str]) -> list[str]:
    """`file:line 'name'` for every string constant equal to a strategy's name outside its
    wing and the registry (docstrings and messages that mention one are not such constants)."""
    found = []
    for rel, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            value = node.value if isinstance(node, ast.Constant) else None
            stray = rel != REGISTRY and not _in_wing(rel, str(value))
            if isinstance(value, str) and value in names and stray:
                found.append(f"{rel}:{node.lineno} {value!r}")
    return found


def package_sources() -> dict[Path, str]:
    return {p.relative_to(ROOT): p.read_text() for p in sorted(ROOT.rglob("*.py"))}


def test_a_strategys_name_is_a_literal_only_in_its_wing_and_the_registry():
    assert stray_literals(package_sources(), set(strategies())) == []


def test_the_check_sees_a_name_compared_outside_its_wing():
    planted = {
        **package_sources(),
        Path("planner/prior.py"): "def f(c):\n    return c.strategy == 'fsdp'\n",
        Path("engine/parallel/ddp.py"): "X = 'deepspeed'\n",  # another wing's name
    }
    assert stray_literals(planted, set(strategies())) == [
        "engine/parallel/ddp.py:1 'deepspeed'",
        "planner/prior.py:2 'fsdp'",
    ]


@pytest.mark.parametrize("name", list(strategies()))
def test_each_registered_name_is_a_wing_of_that_name(name):
    cls = strategy_class(name)
    assert issubclass(cls, Strategy) and cls.name == name
    assert strategy_entry(name).wing == f"{cls.__module__}:{cls.__qualname__}"
    assert cls.min_workers >= 1
    # its cost model answers for any layout of its: the prior asks it, never its name
    for mode in cls.planner_modes(name) or [{}]:
        shape = CostShape(
            params=1e6, workers=4, data_parallel=4, shard_ranks=4, replicate=1, micro_steps=4,
            slots=2, gpu=False, offload=bool(mode.get("offload")),
            grad_sync=mode.get("grad_sync"), zero_stage=mode.get("zero_stage"),
            reshard_after_forward=True, bf16_gathers=False, largest_unit=2e5, recomputed=0.0,
            units=5, latency_s=1e-4, allreduce=lambda n, across: 1e-9,
            gather=lambda n, across: 1e-9, crosses=False, host_link=16e9,
        )  # fmt: skip
        cost = cls.cost(shape)
        assert cost.states > 0 and cost.gathered >= 0 and cost.comm_s > 0, (mode, cost)
        assert 1 <= cost.optimizer_ranks <= 4
    assert _in_wing(Path(cls.__module__.replace(".", "/")).relative_to("rayacc"), name)


def test_every_section_belongs_to_a_registered_strategy():
    from rayacc.config import TrainConfig

    for section, owner in strategy_sections().items():
        assert owner in strategies() and section in TrainConfig.model_fields


def test_an_unknown_name_is_refused_naming_the_registered_ones():
    with pytest.raises(ValueError, match="ddp, fsdp, deepspeed"):
        strategy_entry("megatron")
    assert list(strategy_classes()) == list(strategies())


def test_a_state_format_says_which_resumes_it_cannot_take():
    """The checkpoint's own format answers, on the driver: DeepSpeed's moves to another worker
    count with Adam's state only; the others at any count under any optimizer."""
    from rayacc.engine.parallel import state_format_named

    zero = state_format_named("deepspeed")
    (issue,) = zero.resize_issues(2, 1, "sgd")
    assert "written by 2 workers, this config starts 1" in issue and "'sgd'" in issue
    assert zero.resize_issues(2, 1, "adamw") == []
    for name in ("dcp", "whole"):
        assert state_format_named(name).resize_issues(2, 1, "sgd") == []
    assert state_format_named("pickle") is None
