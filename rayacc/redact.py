"""Credentials out of everything rayacc writes or prints: the one matcher every boundary uses
(console streams, files in run storage and checkpoints, PLAN.yaml and reports, MLflow, job
entrypoints, messages).

The shapes a credential takes, each masked to `***`:
- a URI's userinfo, `scheme://user:password@host` or `scheme://token@host`, masked to
  `scheme://***@host` (a user part alone may be the secret). The userinfo runs from `://` to the
  last `@` before the line ends or the next `://` begins, so a password holding `@`, `/`,
  quotes, `<`, `>` or spaces goes whole; an `@` later on the line (in a path, an address)
  masks more than it must: never less.
- a token in a query string or fragment (`?`, `&`, `;` or `#` then a known key, `=`, the
  value): presigned URLs (S3, GCS, Azure SAS), OAuth, API keys; the value runs to the next
  `&`, `;`, `#`, quote, `<`, `>` or space.
- a keyed value: a key whose last word is a secret's (`password`, `token`, `secret`,
  `api_key`, `access_key`, `authorization`, …), then `=` or `:` (only `=` after a `.`: a
  dotted path then `:` is a message about a config field), then the value — a libpq
  string (`host=db password=pw`), an environment line (`AWS_SECRET_ACCESS_KEY=…`,
  `MLFLOW_TRACKING_PASSWORD=…`), JSON or a Python mapping (`"api_key": "…"`), YAML, an HTTP
  header (`Authorization: Bearer …`, the scheme word kept). A quoted value goes to its
  closing quote; a bare one to a space, quote, `&`, `;`, `,` or a bracket.
- a command line's secret flag: `--password VALUE`, `--db-password=VALUE`, `--api-key VALUE`.
- a bearer token on its own (`Bearer eyJ…`: 16 characters or more, a digit among them; prose
  and identifiers have neither).
- the well-known token formats, wherever they stand: GitHub (`ghp_…`, `gho_…`, `ghu_…`,
  `ghs_…`, `ghr_…`, `github_pat_…`), Hugging Face (`hf_…`), GitLab (`glpat-…`), OpenAI and
  Anthropic (`sk-…`), Slack (`xox…-`), and an AWS key id (`AKIA…`, `ASIA…`) with the
  40-character secret that follows it.

The matcher takes time linear in its input: every pattern starts at a boundary it checks with
one look behind, and what follows is bounded by the next boundary (bench/redact_speed.py; it
uses no possessive quantifier). Every console
line and MLflow tag goes through it.
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

_KEY_WORDS = (
    "password",
    "passwd",
    "passphrase",
    "pwd",
    "secret",
    "token",
    "apikey",
    "api_key",
    "api-key",
    "access_key",
    "access-key",
    "accesskey",
    "private_key",
    "private-key",
    "credential",
    "credentials",
    "signature",
    "auth",
    "authorization",
)
"""The last word of a key whose value is a secret (`AWS_SECRET_ACCESS_KEY` ends in
`access_key`, `MLFLOW_TRACKING_TOKEN` in `token`): the word must start the key or follow a
character that is not a letter or digit."""

_FLAG_WORDS = (
    "password",
    "passwd",
    "passphrase",
    "secret",
    "token",
    "api-key",
    "apikey",
    "access-key",
    "secret-key",
    "private-key",
    "credential",
    "credentials",
    "auth",
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
# precedes (so each run is tried once; inside it nothing but `://` can end the scheme). The
# userinfo then runs to the last `@` before the line's end or the next `://`.
_USERINFO = re.compile(
    r"(?<![a-zA-Z0-9+.\-])(?P<scheme>[0-9+.\-]*[a-zA-Z][a-zA-Z0-9+.\-]*://)"
    r"(?:(?!://)[^\n\r])*@"
)
_QUERY = re.compile(
    r"(?P<key>[?&;#](?=[a-zA-Z])" + _trie(_QUERY_KEYS) + r"=)[^&;#\s'\"<>]+", re.IGNORECASE
)
# a value: quoted to its closing quote (JSON's escapes inside), or bare to a delimiter
_VALUE = r"(?P<value>\"(?:[^\"\\\n]|\\.)*\"|'[^'\n]*'|[^\s&;,'\"<>(){}\[\]]+)"
# the key: an identifier (a dotted path's last part) whose last word is a secret's; after a
# dotted path only `=` is keyed (an override, `model.kwargs.token=…`): a dotted path then
# `:` is a message about a config field (`train.loss_chunk_token: unknown key`)
_KEYED = re.compile(
    r"(?P<key>(?<![\w.\-])(?P<dots>(?:[\w\-]+\.)+)?(?:[\w\-]*[_\-])?"
    + _trie(_KEY_WORDS)
    + r"[\"']?[ \t]*(?(dots)=|[:=])[ \t]*(?:(?:bearer|basic|token|digest|negotiate)[ \t]+)?)"
    + _VALUE,
    re.IGNORECASE,
)
_FLAG = re.compile(
    r"(?P<key>(?<![a-zA-Z0-9-])--?(?:[a-zA-Z0-9_]+[-_])*"
    + _trie(_FLAG_WORDS)
    + r"(?:=|[ \t]+))"
    + _VALUE,
    re.IGNORECASE,
)
_BEARER = re.compile(
    r"(?P<key>(?<![a-zA-Z0-9])bearer[ \t]+)(?=[a-zA-Z\-._~+/]*[0-9])"
    r"(?P<value>[a-zA-Z0-9\-._~+/]{16,}=*)",
    re.IGNORECASE,
)
_TOKEN = re.compile(
    r"(?<![a-zA-Z0-9])(?:"
    r"gh[pousr]_[a-zA-Z0-9]{30,}"
    r"|github_pat_[a-zA-Z0-9_]{20,}"
    r"|hf_[a-zA-Z0-9]{30,}"
    r"|glpat-[a-zA-Z0-9_\-]{20,}"
    r"|sk-[a-zA-Z0-9_\-]{20,}"
    r"|xox[abposr]-[a-zA-Z0-9\-]{10,}"
    r"|(?:AKIA|ASIA)[A-Z0-9]{16}(?![a-zA-Z0-9])"
    r"(?:[ \t,:;=|'\"]{1,4}[a-zA-Z0-9/+]{40}(?![a-zA-Z0-9+=]))?"
    r")"
)


def _keep_quotes(match: re.Match) -> str:
    value = match["value"]
    quote = value[0] if value[0] in "\"'" else ""
    return f"{match['key']}{quote}{MASK}{quote}"


_KEY_STEMS = ("pass", "pwd", "secret", "token", "key", "credential", "auth", "signature")
_TOKEN_PREFIXES = ("gh", "github_pat_", "hf_", "glpat-", "sk-", "xox", "AKIA", "ASIA")


def _shapes_in(text: str) -> list[tuple[re.Pattern, Any]]:
    """The patterns worth trying on `text`, each with its replacement: a pattern is tried only
    where a substring it needs is present, so a plain log line (most of what passes) costs a
    few substring searches. Masking only removes text, so what `text` rules out stays out."""
    low = text.lower()
    keyed = any(stem in low for stem in _KEY_STEMS)
    wanted = [
        ("://" in text, _USERINFO, rf"\g<scheme>{MASK}@"),
        ("=" in text, _QUERY, rf"\g<key>{MASK}"),
        (keyed and ("=" in text or ":" in text), _KEYED, _keep_quotes),
        (keyed and "-" in text, _FLAG, _keep_quotes),
        ("bearer" in low, _BEARER, _keep_quotes),
        (any(prefix in text for prefix in _TOKEN_PREFIXES), _TOKEN, MASK),
    ]
    return [(pattern, replace) for needed, pattern, replace in wanted if needed]


def _mask_str(text: str) -> str:
    for pattern, replace in _shapes_in(text):
        text = pattern.sub(replace, text)
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
    return any(pattern.search(text) is not None for pattern, _ in _shapes_in(text))


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

    def write_data(self, text: str) -> int:
        """Writes what a command was asked to show (a job's logs: Ray's records in them
        included), masked like any line; a console stream that drops Ray's records keeps
        this."""
        return RedactingStream.write(self, text)

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
