"""Credentials out of everything rayacc logs or prints."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["redact"]

# scheme://user:password@host and scheme://token@host → scheme://***@host: a user part alone
# may itself be the secret
_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")


def redact(value: Any) -> Any:
    """`value` with the credentials of any URI in it masked (strings; containers recursively;
    anything else as it is)."""
    if isinstance(value, str):
        return _USERINFO.sub(r"\g<scheme>***@", value)
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value
