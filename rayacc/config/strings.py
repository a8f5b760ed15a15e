"""Every string of a config, checked in one walk:
- a credential: a string field holds one only where it names a place (a URI's userinfo, a
  presigned query), and there it is masked wherever it is shown. Anywhere else — a run or
  experiment name, a model factory's argument, a sweep's name — it would be stored as it
  stands (MLflow shows names and params to everyone who reads the store, a run's folder is
  named by `run.name`), so it is refused, naming the field and never quoting the value;
- a control character (a NUL, a line break): no name, path or URI holds one (a path with a
  NUL cannot even be opened), so it is refused wherever it stands."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from rayacc.config.errors import MISSING, ConfigIssue
from rayacc.redact import credential_spans

__all__ = ["CHECKED_ELSEWHERE", "PLACE", "may_hold_credentials", "string_issues"]

PLACE = {"credentials": "masked"}
"""`json_schema_extra` of a field that names a place (a path or URI): it may carry the
credentials of the store it names, masked wherever it is shown."""
CHECKED_ELSEWHERE = {"credentials": "checked where applied"}
"""`json_schema_extra` of a field whose strings become another config's (a sweep's overrides,
grid and inline base): checked there, field by field."""


def may_hold_credentials(model: type[BaseModel], name: str) -> bool:
    extra = model.model_fields[name].json_schema_extra
    return isinstance(extra, dict) and "credentials" in extra


def _strings(value: Any, path: str, places: bool):
    """Every string inside `value` (keys of mappings too), with its dotted path; `places`:
    also those of fields that may hold credentials."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            if places or not may_hold_credentials(type(value), name):
                yield from _strings(
                    getattr(value, name), f"{path}.{name}" if path else name, places
                )
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key, f"{path} (a key)", places)
            # `path['key']`: a key like `token` followed by `:` would read as a keyed secret
            yield from _strings(item, f"{path}[{key!r}]", places)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _strings(item, f"{path}[{i}]", places)


def _control(text: str) -> bool:
    return any((ord(c) < 32 and c != "\t") or ord(c) == 127 for c in text)


def string_issues(config: BaseModel) -> list[ConfigIssue]:
    """One issue per field (places excepted) that holds a credential, and one per string
    anywhere that holds a control character."""
    issues = [
        ConfigIssue(
            path,
            "holds what looks like a credential (a password, token or key); this field is "
            "stored and shown as written (MLflow names and params, folder names), so it is "
            "refused",
            MISSING,
            "give credentials through the environment their tool reads (MLFLOW_TRACKING_TOKEN, "
            "HF_TOKEN, AWS_SECRET_ACCESS_KEY, …) or in the URI of the place they open",
        )
        for path, text in _strings(config, "", places=False)
        # by shape: a value this config registered by its key (`hub_token: …`) is masked by
        # value wherever it is shown, and reading the config again must not refuse it
        if credential_spans(text)
    ]
    issues += [
        ConfigIssue(
            path,
            "holds a control character (a NUL, a line break): no name, path or URI has one",
            MISSING,
            "write it on one line, without control characters",
        )
        for path, text in _strings(config, "", places=True)
        if _control(text)
    ]
    return issues
