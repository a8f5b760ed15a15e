"""Boundaries proven by class, the cases generated from the definitions: every field of the
config and sweep schemas (a wrong type, a value out of its declared range, a near-miss key),
every flag and argument the command-line parser declares (its kind's malformed value), every
file kind a command reads in each damaged form, and a credential of each shape the matcher
knows planted in every string field and flag. A field, flag or file kind added tomorrow is in
these tests the day it lands. Each case runs the real command in this process: exit 2 naming
the field, flag or file, no traceback, no Ray started, no cluster asked, nothing written."""

from __future__ import annotations

import argparse
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, TypeAdapter, ValidationError

from rayacc.cli import build_parser
from rayacc.config import TrainConfig
from rayacc.config.credentials import may_hold_credentials
from rayacc.config.sweep import SweepConfig
from rayacc.driver.arguments import Kind
from tests.support import ROOT
from tests.support.cli import Ran, rayacc_here

JOB = ROOT / "jobs" / "digits.yaml"
JOB_DICT = yaml.safe_load(JOB.read_text())


# ----------------------------------------------------------------------------- the schema walk
def _section(annotation: Any) -> type[BaseModel] | None:
    return (
        annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    )


def leaves(model: type[BaseModel], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted path, field, owning model) of every value field, through the sections."""
    out = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        section = _section(field.annotation)
        if section is not None:
            out += leaves(section, path + ".")
        else:
            out.append((path, field, model))
    return out


def sections(model: type[BaseModel], prefix: str = "") -> list[str]:
    return [
        f"{prefix}{name}"
        for name, field in model.model_fields.items()
        if _section(field.annotation) is not None
    ]


CONFIG_FIELDS = leaves(TrainConfig)
SWEEP_FIELDS = leaves(SweepConfig)


def _adapter(field) -> TypeAdapter:
    return TypeAdapter(
        typing.Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation
    )


def _accepts(field, value: Any) -> bool:
    try:
        _adapter(field).validate_python(value)
    except ValidationError:
        return False
    return True


def wrong_type(field) -> Any:
    """A value of a type the field never takes (the first of a few that its type refuses)."""
    for value in ({"zz": [1]}, [[1]], "zz-not-a-value"):
        if not _accepts(field, value):
            return value
    raise AssertionError(f"no wrong type found for {field}")


def _bounds(annotation: Any, metadata: list) -> list[tuple[type, Any]]:
    """(number type, bound object) of every range constraint in the annotation, where it sits
    (a field's metadata, an Annotated branch of a union, a list's items, a dict's values)."""
    found = []
    base = annotation
    meta = list(metadata)
    if typing.get_origin(annotation) is typing.Annotated:
        base, *extra = typing.get_args(annotation)
        meta += extra
    origin = typing.get_origin(base)
    branches = typing.get_args(base) if origin in (typing.Union, types.UnionType) else (base,)
    numbers = [b for b in branches if b in (int, float)]
    kind = numbers[0] if numbers else None  # `int | None`: the field's constraints are the int's
    for m in meta:
        for c in getattr(m, "metadata", [m]):
            if kind and any(hasattr(c, k) for k in ("ge", "gt", "le", "lt")):
                found.append((kind, c))
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(base):
            if typing.get_origin(arg) is typing.Annotated:
                found += _bounds(arg, [])
    return found


def out_of_range(field) -> list[Any]:
    """Values just outside each range the field declares (its items' and a mapping's values'
    too), and outside a pattern it must match."""
    values = []
    ann = field.annotation
    for kind, c in _bounds(ann, field.metadata):
        step = 1 if kind is int else 0.5
        if getattr(c, "ge", None) is not None:
            values.append(kind(c.ge - step))
        if getattr(c, "gt", None) is not None:
            values.append(kind(c.gt))
        if getattr(c, "le", None) is not None:
            values.append(kind(c.le + step))
        if getattr(c, "lt", None) is not None:
            values.append(kind(c.lt))
    for container in _containers(ann):
        origin, args = typing.get_origin(container), typing.get_args(container)
        if origin is list:
            values += [[v] for v in _item_out_of_range(args[0])]
        elif origin is tuple:
            values += [[v] * len(args) for v in _item_out_of_range(args[0])]
        elif origin is dict:
            values += [{1: v} for v in _item_out_of_range(args[1])]
            values += [{k: 1} for k in _item_out_of_range(args[0])]
    if any(getattr(m, "pattern", None) for m in field.metadata):
        values.append("../outside")
    return values


def _containers(annotation: Any) -> list[Any]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return [c for arg in typing.get_args(annotation) for c in _containers(arg)]
    return [annotation] if origin in (list, tuple, dict) else []


def _item_out_of_range(annotation: Any) -> list[Any]:
    class Probe:
        pass

    Probe.annotation, Probe.metadata = annotation, []
    return out_of_range(Probe)


def near_miss(path: str) -> str:
    """The path with its last key misspelt (its last letter dropped, or one added)."""
    *parents, last = path.split(".")
    return ".".join([*parents, last[:-1] if len(last) > 2 else last + "x"])


def _flow(value: Any) -> str:
    return (
        yaml.safe_dump(value, default_flow_style=True, width=10**6)
        .strip()
        .removesuffix("...")
        .strip()
    )


# ----------------------------------------------------------------------------- running a command
@pytest.fixture
def here(tmp_path, monkeypatch, capsys):
    """Runs `rayacc ARGV` in this process in an empty working folder, with every way to a
    cluster closed (Ray's start, the Jobs API): returns what it printed and what it left."""
    import ray
    import ray.job_submission

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)

    def closed(*_a, **_k):
        raise SystemExit(99)  # past the checks: a cluster would be asked

    monkeypatch.setattr(ray, "init", closed)
    monkeypatch.setattr(ray.job_submission.JobSubmissionClient, "__init__", closed)
    monkeypatch.setattr("rayacc.driver.fit.ensure_ray", closed)

    def run(argv: list[str], **env: str) -> Ran:
        before = _files(work)
        ran = rayacc_here([str(a) for a in argv], capsys, monkeypatch, **env)
        left = _files(work) - before
        assert "Traceback" not in ran.err, ran.err
        return Ran(ran.code, ran.out, ran.err + "".join(f"\n<left {p}>" for p in sorted(left)))

    run.work = work
    return run


def _files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def _refused(ran: Ran, *names: str) -> None:
    assert ran.code == 2, ran
    assert "<left" not in ran.err, ran.err  # nothing written
    for name in names:
        assert name in ran.err, (name, ran.err)


# ----------------------------------------------------------------------------- 1. the schemas
@pytest.mark.parametrize("path", [p for p, _, _ in CONFIG_FIELDS])
def test_every_config_field_refuses_a_wrong_type(path, here, tmp_path):
    field = dict((p, f) for p, f, _ in CONFIG_FIELDS)[path]
    value = wrong_type(field)
    _refused(here(["plan", "-c", JOB, f"{path}={_flow(value)}"]), path)
    # the same in a job file
    job = _set(JOB_DICT, path, value)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    _refused(here(["plan", "-c", tmp_path / "job.yaml"]), path, "job.yaml")


RANGED = [(p, v) for p, f, _ in CONFIG_FIELDS for v in out_of_range(f)]


@pytest.mark.parametrize(("path", "value"), RANGED, ids=[f"{p}={v!r}" for p, v in RANGED])
def test_every_config_field_refuses_a_value_out_of_its_range(path, value, here):
    _refused(here(["plan", "-c", JOB, f"{path}={_flow(value)}"]), path.split(".")[0])


def _numbers_in(annotation: Any) -> bool:
    if annotation in (int, float):
        return True
    return any(_numbers_in(a) for a in typing.get_args(annotation) if a is not type(None))


UNBOUNDED = {}
"""Numeric fields without a declared range, each with why every number is one of its values."""


def test_every_numeric_config_field_declares_its_range():
    """A number without a range passes the schema and fails later, far from the field (an
    AdamW beta of 2, a negative layer width): each numeric field has one."""
    missing = [
        p
        for p, f, _ in CONFIG_FIELDS
        if _numbers_in(f.annotation) and not out_of_range(f) and p not in UNBOUNDED
    ]
    assert not missing, f"give these fields a range (Field(ge=…)): {missing}"


@pytest.mark.parametrize("path", [p for p, _, _ in CONFIG_FIELDS] + sections(TrainConfig))
def test_every_config_key_misspelt_is_named_with_the_right_one(path, here):
    ran = here(["plan", "-c", JOB, f"{near_miss(path)}=1"])
    _refused(ran, "unknown key", f"did you mean '{path}'")


SWEEP_BASE = {"base": str(JOB), "grid": {"batch.micro_batch_size": [16]}}


def _sweep_cases() -> list[tuple[str, str, Any]]:
    cases = []
    for path, field, _ in SWEEP_FIELDS:
        cases.append((path, "wrong type", wrong_type(field)))
        cases += [(path, "out of range", v) for v in out_of_range(field)]
    return cases


@pytest.mark.parametrize(("path", "what", "value"), _sweep_cases())
def test_every_sweep_field_refuses_a_wrong_value(path, what, value, here, tmp_path):
    sweep = _set(SWEEP_BASE, path, value)
    if path == "config":  # the other of base and config
        sweep.pop("base")
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    _refused(here(["sweep", "-c", tmp_path / "sweep.yaml"]), path.split(".")[0], "sweep.yaml")


@pytest.mark.parametrize("path", [p for p, _, _ in SWEEP_FIELDS] + sections(SweepConfig))
def test_every_sweep_key_misspelt_is_named_with_the_right_one(path, here, tmp_path):
    sweep = _set(SWEEP_BASE, near_miss(path), 1)
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    _refused(here(["sweep", "-c", tmp_path / "sweep.yaml"]), "unknown key", f"'{path}'")


def _set(data: dict, path: str, value: Any) -> dict:
    import copy

    data = copy.deepcopy(data)
    node = data
    *parents, last = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return data
