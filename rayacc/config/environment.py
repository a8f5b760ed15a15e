"""The environment variables that stand for config fields (`env.FIELD_VARIABLES`), checked as
the fields they stand for: a second door to a field, with the field's lock."""

from __future__ import annotations

import os

from pydantic import BaseModel, ValidationError

from rayacc.config.errors import MISSING, ConfigIssue, issues_from_validation
from rayacc.config.strings import string_issues

__all__ = ["environment_issues"]


def environment_issues(cfg: BaseModel) -> list[ConfigIssue]:
    """The issues of each variable that stands for a field the config leaves null
    (`env.FIELD_VARIABLES`), found by validating the config with the variable's value in that
    field: the same checks, named by the variable (its value is never quoted)."""
    from rayacc.env import FIELD_VARIABLES

    issues: list[ConfigIssue] = []
    for variable, path in FIELD_VARIABLES.items():
        value = os.environ.get(variable)
        section, name = path.split(".")
        if not value or getattr(getattr(cfg, section), name) is not None:
            continue
        data = cfg.model_dump()
        data[section][name] = value
        found: list[ConfigIssue] = []
        try:
            found = string_issues(type(cfg).model_validate(data))
        except ValidationError as exc:
            found = issues_from_validation(exc, type(cfg))
        for issue in found:
            if issue.path == path:
                issues.append(
                    ConfigIssue(
                        f"${variable} (it stands for {path}, null in the config)",
                        issue.message,
                        MISSING,
                        issue.fix,
                    )
                )
    return issues
