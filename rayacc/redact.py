"""Credentials out of everything rayacc writes or prints: the one matcher every boundary uses
(console streams, files in run storage and checkpoints, PLAN.yaml and reports, MLflow, job
entrypoints, messages).

Two shapes are credentials:
- a URI's userinfo, `scheme://user:password@host` or `scheme://token@host`, masked to
  `scheme://***@host` (a user part alone may be the secret). The userinfo runs from `://` to the
  last `@` before the line ends or the next `://` begins, so a password holding `@`, `/`,
  quotes, `<`, `>` or spaces goes whole; an `@` later on the line (in a path, an address)
  masks more than it must: never less.
- a token in a query string or fragment (`?`, `&`, `;` or `#` then a known key, `=`, the
  value): presigned URLs (S3, GCS, Azure SAS), OAuth, API keys; the value runs to the next
  `&`, `;`, `#`, quote, `<`, `>` or space.

The matcher takes time linear in its input (a scheme is looked for once per run of scheme
characters, a userinfo's stretch once per `://`, a query key through a trie from one of four
characters): every console line and MLflow tag goes through it (bench/redact_speed.py).
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["MASK", "RedactingStream", "contains_secret", "redact"]

MASK = "***"

_QUERY_KEYS = (
    "sig",
    "signature",
    "x-amz-signature",
    "x-amz-security-token",
    "x-amz-credential",
    "x-goog-signature",
    "x-goog-credential",
    "awsaccesskeyid",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "access_key",
    "secret_key",
    "token",
    "access_token",
    "refresh_token",
    "id_token",
    "private_token",
    "auth",
    "auth_token",
    "authorization",
    "credential",
    "credentials",
    "api_key",
    "api-key",
    "apikey",
    "key",
    "password",
    "passwd",
    "pwd",
    "secret",
    "client_secret",
)


def _trie(words) -> str:
    """One alternation of `words` as a trie (common prefixes once): the engine tries a
    character at each branch instead of every word in turn."""
    root: dict = {}
    for word in words:
        node = root
        for ch in word.lower():
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict) -> str:
        branches = [re.escape(ch) + build(node[ch]) for ch in sorted(k for k in node if k)]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 and "" not in node else f"(?:{'|'.join(branches)})"
        return body + ("?" if "" in node else "")

    return build(root)


# A scheme starts at the first letter of a run of scheme characters that nothing of the kind
# precedes, and is taken whole (possessive): each run is scanned once, whatever follows. The
# userinfo then runs to the last `@` before the line's end or the next `://`.
_USERINFO = re.compile(
    r"(?<![a-zA-Z0-9+.\-])(?P<scheme>[0-9+.\-]*+[a-zA-Z][a-zA-Z0-9+.\-]*+://)"
    r"(?:(?!://)[^\n\r])*@"
)
_QUERY = re.compile(
    r"(?P<key>[?&;#](?=[a-zA-Z])" + _trie(_QUERY_KEYS) + r"=)[^&;#\s'\"<>]+", re.IGNORECASE
)


def _mask_str(text: str) -> str:
    if "://" in text:
        text = _USERINFO.sub(rf"\g<scheme>{MASK}@", text)
    if "=" in text:
        text = _QUERY.sub(rf"\g<key>{MASK}", text)
    return text


def redact(value: Any) -> Any:
    """`value` with every credential in it masked (strings; containers recursively; anything
    else as it is)."""
    if isinstance(value, str):
        return _mask_str(value)
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value


def contains_secret(text: str) -> bool:
    """Whether the matcher finds a credential in `text` (masked already or not)."""
    return _USERINFO.search(text) is not None or _QUERY.search(text) is not None


class RedactingStream:
    """A text stream (stdout, stderr) that masks credentials in what is written to it: the
    console's boundary, for rayacc's own lines and for any library's. It masks whole lines
    (ended by a line feed or a carriage return): a URI written in pieces is masked as one.
    A partial line waits for its end, or for `release()` (the CLI calls it when the command
    ends); one longer than `MAX_LINE` characters is masked and written as it stands."""

    MAX_LINE = 1 << 20

    def __init__(self, stream):
        self._stream = stream
        self._partial = ""

    def write(self, text: str) -> int:
        if not text:
            return 0
        pending = self._partial + text
        cut = max(pending.rfind("\n"), pending.rfind("\r")) + 1
        if cut == 0 and len(pending) > self.MAX_LINE:
            cut = len(pending)
        self._partial = pending[cut:]
        if cut:
            self._emit(pending[:cut])
        return len(text)

    def _emit(self, lines: str) -> None:
        self._stream.write(redact(lines))

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def release(self) -> None:
        """Writes the partial line held back, masked, and flushes."""
        if self._partial:
            text, self._partial = self._partial, ""
            self._emit(text)
        self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)
