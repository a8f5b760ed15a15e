"""`key.path=value` overrides applied to a config mapping, and the config as dotted keys."""

from __future__ import annotations

import copy
from typing import Any

import yaml
from pydantic import BaseModel

from rayacc.config.errors import MISSING, ConfigIssue, is_value_field
from rayacc.config.loader import DuplicateKeyError, load_yaml_text

__all__ = ["apply_overrides", "flatten"]


def apply_overrides(
    data: dict[str, Any],
    overrides: list[str],
    issues: list[ConfigIssue],
    model: type[BaseModel],
) -> dict[str, Any]:
    """A copy of `data` with each `key.path=value` set (the value parsed as YAML); malformed
    overrides are appended to `issues`. `model` tells sections from value fields."""
    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            issues.append(
                ConfigIssue(
                    "",
                    "override is not of the form key.path=value",
                    item,
                    "write e.g. batch.micro_batch_size=16",
                )
            )
            continue
        try:
            value = load_yaml_text(raw) if raw.strip() else None
        except DuplicateKeyError as exc:
            issues.append(ConfigIssue(key, f"its value has {exc}", MISSING, "write each key once"))
            continue
        except yaml.YAMLError:
            value = raw
        _set(data, key.split("."), value, issues, model)
    return data


def _set(
    data: dict[str, Any],
    parts: list[str],
    value: Any,
    issues: list[ConfigIssue],
    model: type[BaseModel],
) -> None:
    node = data
    for i, part in enumerate(parts[:-1]):
        prefix = tuple(parts[: i + 1])
        child = node.get(part)
        if child is None and not is_value_field(model, prefix):
            child = node[part] = {}
        if not isinstance(child, dict):
            path = ".".join(prefix)
            issues.append(
                ConfigIssue(
                    path,
                    "is a value, not a section",
                    MISSING if child is None else child,
                    f"override {path}=VALUE instead",
                )
            )
            return
        node = child
    node[parts[-1]] = value


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys, e.g. {"batch": {"micro_batch_size": 8}} →
    {"batch.micro_batch_size": 8}."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out
