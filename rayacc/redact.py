"""Credentials out of everything rayacc writes or prints: the one pattern every boundary uses
(console streams, files in run storage and checkpoints, MLflow, job entrypoints, messages)."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["MASK", "RedactingStream", "redact"]

MASK = "***"

# scheme://user:password@host and scheme://token@host → scheme://***@host: a user part alone
# may itself be the secret. The userinfo runs to the last `@` of the URI (a password may hold
# `@` or `/` unescaped), so everything between the scheme and the host goes (an `@` later in a
# URI's path or query masks more than it must: never less).
_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^\s'\"<>]*@")

# tokens carried in query strings: presigned URLs (S3, GCS, Azure SAS), OAuth and API keys
_QUERY_KEYS = (
    "sig",
    "signature",
    "x-amz-signature",
    "x-amz-security-token",
    "x-amz-credential",
    "x-goog-signature",
    "x-goog-credential",
    "awsaccesskeyid",
    "token",
    "access_token",
    "refresh_token",
    "id_token",
    "api_key",
    "apikey",
    "key",
    "password",
    "passwd",
    "secret",
    "client_secret",
)
_QUERY = re.compile(
    r"(?P<key>[?&;](?:" + "|".join(map(re.escape, _QUERY_KEYS)) + r")=)[^&;#\s'\"<>]+",
    re.IGNORECASE,
)


def redact(value: Any) -> Any:
    """`value` with the credentials of any URI in it masked (strings; containers recursively;
    anything else as it is)."""
    if isinstance(value, str):
        value = _USERINFO.sub(rf"\g<scheme>{MASK}@", value)
        return _QUERY.sub(rf"\g<key>{MASK}", value)
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value


class RedactingStream:
    """A text stream (stdout, stderr) that masks credentials in what is written to it: the
    console's boundary, for rayacc's own lines and for any library's."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(redact(text))
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)
