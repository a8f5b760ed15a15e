"""An environment variable that stands for a config field (`env.FIELD_VARIABLES`) or a flag
(`env.FLAG_VARIABLES`) is checked as that field or flag is: the cases are generated from the
table and from each field's own checks, and every variable the code reads is in the table or
named as no field's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import rayacc
from rayacc.config import ConfigError, TrainConfig
from rayacc.config.strings import may_hold_credentials
from rayacc.env import FIELD_VARIABLES, FLAG_VARIABLES, VARIABLES

NOT_FIELDS = {
    "TORCH_EXTENSIONS_DIR": "where DeepSpeed builds its ops (a cache folder of torch's)",
    "MLFLOW_TRACKING_TOKEN": "a credential MLflow's client reads, never stored",
    "MLFLOW_TRACKING_USERNAME": "a credential MLflow's client reads, never stored",
    "MLFLOW_TRACKING_PASSWORD": "a credential MLflow's client reads, never stored",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "MLflow's client's read timeout, which the health check keeps",
}
"""Variables rayacc reads that stand for nothing of its own (`env.VARIABLES` holds the rest),
and why."""
BASE = {"batch": {"global_batch_size": 8}}


def _bad_values(path: str) -> list[str]:
    """Values the field refuses, by its own checks: a control character anywhere; a credential
    where the field is not a place."""
    section, name = path.split(".")
    model = type(getattr(TrainConfig(), section))
    bad = ["team\nruns", "tab\x7fdel"]  # (a NUL cannot be in an environment at all)
    if not may_hold_credentials(model, name):
        bad.append("password=hunter2")
    return bad


CASES = [(var, path, bad) for var, path in FIELD_VARIABLES.items() for bad in _bad_values(path)]


@pytest.mark.parametrize("variable, path, bad", CASES)
def test_a_variable_that_stands_for_a_field_is_refused_as_the_field_is(
    monkeypatch, variable, path, bad
):
    section, name = path.split(".")
    with pytest.raises(ConfigError) as as_field:
        TrainConfig.from_dict({**BASE, section: {name: bad}})
    assert path in str(as_field.value)
    monkeypatch.setenv(variable, bad)
    with pytest.raises(ConfigError) as as_variable:
        TrainConfig.from_dict(BASE)
    said = str(as_variable.value)
    assert f"${variable}" in said and path in said, said
    assert bad not in said and "hunter2" not in said, "the value is never quoted"
    # the config's own value wins, and the variable is then not read
    good = "sqlite:////tmp/x.db" if "uri" in name else "mine"
    TrainConfig.from_dict({**BASE, section: {name: good}})


@pytest.mark.parametrize("variable, path", FIELD_VARIABLES.items())
def test_a_good_value_of_the_variable_is_taken(monkeypatch, variable, path):
    monkeypatch.setenv(variable, "sqlite:////tmp/x.db" if "uri" in path else "team-runs")
    TrainConfig.from_dict(BASE)


def test_every_variable_the_code_reads_is_a_fields_a_flags_or_named_as_neither():
    root = Path(rayacc.__file__).parent
    read = set()
    for source in root.rglob("*.py"):
        text = source.read_text()
        read |= set(re.findall(r"""environ(?:\.get\(|\[)\s*["']([A-Z][A-Z0-9_]+)["']""", text))
        read |= set(re.findall(r"""getenv\(\s*["']([A-Z][A-Z0-9_]+)["']""", text))
        # a name of rayacc's own, wherever it is spelled (a constant read elsewhere)
        read |= set(re.findall(r"""["'](RAYACC_[A-Z0-9_]+)["']""", text))
    known = {*VARIABLES, *NOT_FIELDS}
    assert read - known == set(), f"read but in no table: {read - known}"


@pytest.mark.parametrize("variable, flag", FLAG_VARIABLES.items())
def test_a_variable_that_stands_for_a_flag_is_refused_as_the_flag_is(monkeypatch, variable, flag):
    from rayacc.driver.arguments import address_problem
    from rayacc.driver.fit import ensure_ray
    from rayacc.driver.places import PlaceError

    bad = "http//not an address"
    assert address_problem(bad) is not None  # what --address refuses
    monkeypatch.setenv(variable, bad)
    with pytest.raises(PlaceError) as refused:
        ensure_ray(TrainConfig().scaling)
    assert f"${variable}" in str(refused.value) and flag in str(refused.value)


def _refused(variable: str) -> dict[str, str]:
    """Values the variable's kind refuses, generated: its own malformed example, a line break,
    and 10 KB (a name's length is MLflow's to judge)."""
    from rayacc.driver.arguments import Name, variable_kinds

    kind = variable_kinds()[variable]
    values = {"line break": "team\nruns"}
    if kind.malformed:
        values["malformed"] = kind.malformed
    if not isinstance(kind, Name):
        values["10 KB"] = "x" * 10_000
    return values


ENV_CASES = [(v, what, bad) for v in VARIABLES for what, bad in _refused(v).items()]


@pytest.mark.parametrize(
    "variable, what, bad", ENV_CASES, ids=[f"{v}-{w}" for v, w, _ in ENV_CASES]
)
def test_every_variable_is_checked_when_a_command_starts(
    monkeypatch, tmp_path, capsys, variable, what, bad
):
    # whatever the command: exit 2 naming the variable and what it stands for, before the
    # command reads anything; no traceback, the value not quoted whole
    from rayacc.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(variable, bad)
    assert main(["runs"]) == 2
    err = capsys.readouterr().err
    assert f"${variable} (it stands for {VARIABLES[variable]})" in err, err
    assert "Traceback" not in err and "Fix:" in err, err
    assert bad not in err and len(err) < 1000, err
    assert not list(tmp_path.iterdir()), "nothing written"
