"""Config problems and the one translator from pydantic's errors to them.

Every problem names the field path, the value given and how to fix it; all problems of a config
are reported together by one :class:`ConfigError`.
"""

from __future__ import annotations

import difflib
from typing import Any, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

__all__ = [
    "MISSING",
    "ConfigError",
    "ConfigIssue",
    "field_at",
    "is_value_field",
    "issues_from_validation",
    "section_at",
]

MISSING: Any = object()
"""The value of an issue that has none worth quoting (a whole section, a missing key)."""


class ConfigIssue:
    """One problem in a config: where, what was given, what is wrong and how to fix it."""

    def __init__(self, path: str, message: str, value: Any = None, fix: str | None = None):
        self.loc: tuple[str, ...] = ()
        self.path = path
        self.message = message
        self.value = value
        self.fix = fix

    def __str__(self) -> str:
        given = "" if self.value is MISSING else f" (got {self.value!r})"
        fix = f" Fix: {self.fix}" if self.fix else ""
        return f"{self.path or '<root>'}: {self.message}{given}.{fix}"

    def __repr__(self) -> str:
        return f"ConfigIssue({self!s})"


class ConfigError(ValueError):
    """All problems found in one config, reported together."""

    def __init__(self, issues: list[ConfigIssue], source: str | None = None):
        self.issues = issues
        self.source = source
        where = f" in {source}" if source else ""
        n = len(issues)
        lines = [f"invalid config{where} ({n} problem{'s' if n != 1 else ''}):"]
        lines += [f"  - {issue}" for issue in issues]
        super().__init__("\n".join(lines))

    def __reduce__(self):
        # rebuilt from its parts where it is unpickled (an error crossing processes, as Ray
        # carries a worker's to the driver): the default would pass the message alone
        return type(self), (self.issues, self.source)

    @property
    def paths(self) -> list[str]:
        return [issue.path for issue in self.issues]


# ----------------------------------------------------------------------------- the schema walker
def _section_model(field: FieldInfo) -> type[BaseModel] | None:
    ann = field.annotation
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def field_at(model: type[BaseModel], loc: tuple[str, ...]) -> FieldInfo | None:
    """The field that the key path `loc` names in `model`, through its sections; None when the
    path names no field (or passes through a field that is not a section)."""
    field: FieldInfo | None = None
    current: type[BaseModel] | None = model
    for part in loc:
        if current is None:
            return None
        field = current.model_fields.get(str(part))
        if field is None:
            return None
        current = _section_model(field)
    return field


def section_at(model: type[BaseModel], loc: tuple[str, ...]) -> type[BaseModel] | None:
    """The section model at `loc` (`model` itself for the empty path), None when not a section."""
    if not loc:
        return model
    field = field_at(model, loc)
    return _section_model(field) if field is not None else None


def is_value_field(model: type[BaseModel], loc: tuple[str, ...]) -> bool:
    """True when `loc` names a known field that holds a plain value (not a section or mapping)."""
    field = field_at(model, loc)
    return (
        field is not None
        and _section_model(field) is None
        and get_origin(field.annotation) is not dict
    )


# ----------------------------------------------------------------------------- the translator
def _fix_for(kind: str, ctx: dict[str, Any]) -> str | None:
    bounds = {
        "greater_than": ">",
        "greater_than_equal": ">=",
        "less_than": "<",
        "less_than_equal": "<=",
    }
    if kind in bounds:
        bound = next(iter(v for k, v in ctx.items() if k in ("gt", "ge", "lt", "le")), "")
        return f"set a value {bounds[kind]} {bound}"
    if kind == "literal_error":
        return f"use one of {ctx.get('expected', '')}"
    return {
        "int_parsing": "use a whole number",
        "int_type": "use a whole number",
        "int_from_float": "use a whole number",
        "float_parsing": "use a number",
        "float_type": "use a number",
        "bool_parsing": "use true or false",
        "bool_type": "use true or false",
        "string_type": "use a string (quote it in YAML)",
        "model_type": "write it as a section of key: value lines",
        "dict_type": "write it as a mapping of key: value",
        "list_type": "write it as a list, e.g. [1, 2]",
        "tuple_type": "write it as a list of two values, e.g. [1, 2]",
    }.get(kind)


_UNION_TAGS = {"int", "float", "str", "bool", "none", "list", "dict", "tuple"}


def _is_union_tag(part: str) -> bool:
    """pydantic names the branch of a union field in the error location (`constrained-int`,
    `literal['auto']`, `tuple[int, int]`); field names never look like that."""
    return "[" in part or "-" in part or part in _UNION_TAGS


def _merge_union_branches(issues: list[ConfigIssue]) -> list[ConfigIssue]:
    """One issue per field: a value that fits no branch of a union gets the branches' fixes."""
    merged: dict[str, ConfigIssue] = {}
    out: list[ConfigIssue] = []
    for issue in issues:
        first = merged.get(issue.path)
        if first is None or issue.message == "unknown key":
            merged[issue.path] = issue
            out.append(issue)
            continue
        fixes = [f for f in (first.fix, issue.fix) if f]
        combined = ConfigIssue(
            issue.path, "is not a valid value", first.value, "; or ".join(dict.fromkeys(fixes))
        )
        combined.loc = issue.loc
        out[out.index(first)] = combined
        merged[issue.path] = combined
    return out


def _unknown_key(model: type[BaseModel], loc: tuple[str, ...]) -> ConfigIssue:
    section = section_at(model, loc[:-1])
    valid = list(section.model_fields) if section is not None else []
    close = difflib.get_close_matches(loc[-1], valid, n=1, cutoff=0.5)
    prefix = ".".join(loc[:-1])
    fix = (
        f"did you mean {(prefix + '.' if prefix else '') + close[0]!r}?"
        if close
        else f"valid keys here: {', '.join(valid)}"
    )
    return ConfigIssue(".".join(loc), "unknown key", MISSING, fix)


def _issue_of(model: type[BaseModel], err: Any) -> ConfigIssue:
    loc = tuple(p for p in err["loc"] if isinstance(p, str) and not _is_union_tag(p))
    kind = err["type"]
    if kind == "extra_forbidden":
        return _unknown_key(model, loc)
    if kind == "value_error":
        # a section's own cross-field rule: the message already names fields and fix
        msg = str(err["msg"]).removeprefix("Value error, ")
        return ConfigIssue(".".join(loc), msg, MISSING)
    value = err.get("input", MISSING)
    issue = ConfigIssue(
        ".".join(loc),
        str(err["msg"]),
        MISSING if isinstance(value, dict) else value,
        _fix_for(kind, err.get("ctx") or {}),
    )
    issue.loc = loc
    return issue


def _entered_branches(errors: list[Any]) -> list[Any]:
    """Where a union field's value had one branch's shape (errors inside the value: a list's
    item, a section's key), the other branches' complaints about its shape are dropped."""

    def split(loc: tuple) -> tuple[tuple, bool]:
        for i, part in enumerate(loc):
            if isinstance(part, str) and _is_union_tag(part):
                return loc[:i], len(loc) > i + 1
        return loc, False

    entered = {split(e["loc"])[0] for e in errors if split(e["loc"])[1]}
    return [e for e in errors if split(e["loc"])[1] or split(e["loc"])[0] not in entered]


def issues_from_validation(exc: ValidationError, model: type[BaseModel]) -> list[ConfigIssue]:
    """pydantic's errors for `model` as issues: unknown keys with the nearest valid one, one
    issue per union field (the branch the value's shape entered, where one did), each fix
    followed by the field's own description."""
    errors = _entered_branches(exc.errors(include_url=False))
    issues = _merge_union_branches([_issue_of(model, err) for err in errors])
    for issue in issues:
        field = field_at(model, issue.loc) if issue.loc else None
        if field is not None and field.description:
            desc = " ".join(field.description.split())
            issue.fix = f"{issue.fix} — {desc}" if issue.fix else desc
    return issues
