"""A strategy's own section set under another strategy is refused, never ignored: every field of
every such section (read from the schema, so a field added tomorrow is covered), under every
other strategy (read from `train.strategy`'s choices) — `deepspeed.stage=3` alone trained under
DDP before. A derived config that switches the strategy (a planner candidate, a sweep trial, a
plan applied to a job) puts the job's settings for its own strategy back to their defaults."""

from __future__ import annotations

import types
import typing

import pytest

from rayacc.config import ConfigError, SweepConfig, TrainConfig
from rayacc.config.rules import strategy_resets
from rayacc.config.strategies import strategies, strategy_sections

GOOD = {"batch": {"global_batch_size": 256, "micro_batch_size": 32}, "scaling": {"num_workers": 2}}
TRAIN = TrainConfig.model_fields["train"].annotation
STRATEGIES = typing.get_args(TRAIN.model_fields["strategy"].annotation)
STRATEGY_SECTIONS = strategy_sections()


def candidates(tp):
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        yield from typing.get_args(tp)
    elif origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            yield from candidates(arg)
    elif origin is typing.Annotated:
        yield from candidates(typing.get_args(tp)[0])
    elif tp is bool:
        yield from (True, False)
    elif tp is int:
        yield from (2, 1)
    elif tp is float:
        yield 0.5
    elif tp is str:
        yield "ds_config.json"


def settings():
    """(section, field, a value other than its default) for every field of every strategy's
    section."""
    for name in STRATEGY_SECTIONS:
        section = TrainConfig.model_fields[name].annotation
        for field, info in section.model_fields.items():
            default = info.get_default(call_default_factory=True)
            value = next(v for v in candidates(info.annotation) if v != default)
            yield name, field, value


SETTINGS = list(settings())


def test_every_field_of_every_strategys_section_is_covered():
    # the schema's names are the registry's
    assert set(STRATEGIES) == set(strategies())
    assert set(STRATEGY_SECTIONS.values()) <= set(STRATEGIES)
    fields = {
        (name, field)
        for name in STRATEGY_SECTIONS
        for field in TrainConfig.model_fields[name].annotation.model_fields
    }
    assert {(name, field) for name, field, _ in SETTINGS} == fields


def foreign_issues(data: dict, key: str) -> list[str]:
    try:
        TrainConfig.from_dict(data)
    except ConfigError as err:
        return [str(i) for i in err.issues if i.path == key and "applies to" in str(i)]
    return []


@pytest.mark.parametrize(("name", "field", "value"), SETTINGS, ids=lambda x: str(x))
def test_a_setting_of_another_strategys_section_is_refused_naming_both(name, field, value):
    for strategy in STRATEGIES:
        data = {**GOOD, "train": {"strategy": strategy}, name: {field: value}}
        found = foreign_issues(data, f"{name}.{field}")
        owner = STRATEGY_SECTIONS[name]
        if strategy == owner:
            assert not found, found
        else:
            assert len(found) == 1, (strategy, found)
            assert f"set train.strategy={owner}" in found[0] and repr(strategy) in found[0]


FSDP_JOB = {**GOOD, "train": {"strategy": "fsdp"}, "fsdp": {"grad_sync": "window_end"}}


def test_a_planner_candidate_of_another_strategy_leaves_the_jobs_fsdp_settings():
    from rayacc.planner.candidates import Candidate, with_candidate

    job = TrainConfig.from_dict(FSDP_JOB)
    assert strategy_resets(job, "ddp") == {"fsdp.grad_sync": "every_micro_step"}
    assert strategy_resets(job, "fsdp") == {}
    ddp = with_candidate(job, Candidate(2, 32, 4))
    assert ddp.train.strategy == "ddp" and ddp.fsdp.grad_sync == "every_micro_step"
    zero = with_candidate(job, Candidate(2, 32, 4, "deepspeed", zero_stage=3))
    assert zero.deepspeed.stage == 3 and zero.fsdp.grad_sync == "every_micro_step"


def test_a_sweep_over_strategies_keeps_each_strategys_settings_to_its_trials():
    from rayacc.driver.sweep import expand_trials

    base = TrainConfig.from_dict(FSDP_JOB).model_dump(mode="json")
    sweep = SweepConfig.model_validate({"grid": {"train.strategy": ["ddp", "fsdp"]}})
    ddp, fsdp = expand_trials(sweep, base)
    assert ddp.config and fsdp.config, (ddp.skip_reason, fsdp.skip_reason)
    assert ddp.config["fsdp"]["grad_sync"] == "every_micro_step"
    assert fsdp.config["fsdp"]["grad_sync"] == "window_end"
