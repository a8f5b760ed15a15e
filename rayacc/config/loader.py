"""The one YAML loader of config and sweep files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from rayacc.config.errors import MISSING, ConfigError, ConfigIssue

__all__ = ["read_yaml"]


def read_yaml(path: str | os.PathLike, kind: str, example: str) -> Any:
    """The parsed contents of the YAML file at `path` (None for an empty file); a missing file
    or bad YAML is a ConfigError naming the file. `kind` and `example` word the fix."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(
            [
                ConfigIssue(
                    "",
                    f"{kind} file not found",
                    str(p),
                    f"pass an existing YAML file, e.g. -c {example}",
                )
            ],
            str(p),
        )
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            [
                ConfigIssue(
                    "",
                    f"not a text file (byte {exc.start} is not UTF-8)",
                    MISSING,
                    f"pass the {kind} YAML file itself, e.g. -c {example}",
                )
            ],
            str(p),
        ) from None
    except OSError as exc:
        raise ConfigError(
            [ConfigIssue("", f"cannot be read ({exc.strerror})", MISSING, "check its permissions")],
            str(p),
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(
            [ConfigIssue("", f"not valid YAML: {exc}", MISSING, "correct the YAML syntax")],
            str(p),
        ) from None
