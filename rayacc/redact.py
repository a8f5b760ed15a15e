"""Credentials out of everything rayacc writes or prints: the one matcher every boundary uses
(console streams, files in run storage and checkpoints, PLAN.yaml and reports, MLflow, job
entrypoints, messages). What it masks is `CATALOGUE` (the README's security section is made
from it).

More: docs/design.md, "Notes from the code" (redact.py).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CATALOGUE",
    "MASK",
    "RedactingStream",
    "Shape",
    "catalogue_table",
    "contains_secret",
    "redact",
]

MASK = "***"


@dataclass(frozen=True)
class Shape:
    """One shape the matcher masks: its name, an example (what is masked in brackets)."""

    name: str
    example: str


# ----------------------------------------------------------------------------- words
SECRET_WORDS = frozenset(
    (  # noqa: SIM905 (a list of words, read as one)
        "password passwd passphrase pwd secret token credential credentials signature auth "
        "authorization apikey accesskey secretkey privatekey accountkey "
    ).split()
)
"""A key that ends in one of these holds a secret (`AWS_SECRET_ACCESS_KEY`, `sessionToken`,
`db_password`)."""
KEY_QUALIFIERS = frozenset(
    {"api", "access", "secret", "private", "account", "shared", "signing", "master", "client"}
)
"""... or that ends in `key` after one of these (`api_key`, `AccountKey`, `X-Api-Key`)."""
WEAK_WORDS = frozenset({"key", "pass", "pw"})
"""... or one of these (alone or after another word) with a value of at least 16 characters
(`cloudant_key=<64 hex>`): a short value is a dictionary key's, a count's, a name's."""
WEAK_MIN = 16
_STRONG_ENDS = tuple(SECRET_WORDS) + tuple(f"{q}key" for q in sorted(KEY_QUALIFIERS))
_WEAK_ENDS = tuple(WEAK_WORDS)
SCHEME_WORDS = frozenset({"bearer", "basic", "token", "digest", "negotiate"})
"""An HTTP authorization scheme, kept before the masked value."""
QUERY_KEYS = frozenset(
    (  # noqa: SIM905
        "sig signature x-amz-signature x-amz-security-token x-amz-credential x-goog-signature "
        "x-goog-credential awsaccesskeyid aws_access_key_id aws_secret_access_key "
        "aws_session_token access_key secret_key token access_token refresh_token id_token "
        "private_token auth auth_token authorization credential credentials api_key api-key "
        "apikey key password passwd pwd secret client_secret "
    ).split()
)
"""A query or fragment key whose value is a secret (presigned URLs, OAuth, API keys)."""

_STEMS = ("pass", "pwd", "pw", "secret", "token", "key", "credential", "auth", "sig")
"""Every secret word holds one of these (lower case): a line without any has no keyed value."""
_STEM_GATE = re.compile("|".join(_STEMS))
_QUERY_MARKS = re.compile(r"[?&;#]")


@functools.lru_cache(maxsize=4096)
def _secret_key(key: str) -> str:
    """'': not a secret's key; 'strong': its value is masked; 'weak': masked when long. The
    key's last dotted part, its `_` and `-` dropped, in lower case, ends with a secret word:
    every casing reads the same (`secretAccessKey`, `SECRET_ACCESS_KEY`, `secret-access-key`
    all end in `accesskey`), and a word inside another (`tokenizer`, `keyboard`, `author`)
    ends the key otherwise."""
    low = key.rsplit(".", 1)[-1].lower()
    if not any(stem in low for stem in _STEMS):
        return ""
    flat = low.replace("_", "").replace("-", "")
    if flat.endswith(_STRONG_ENDS):
        return "strong"
    return "weak" if flat.endswith(_WEAK_ENDS) else ""


# ----------------------------------------------------------------------------- patterns
_RUN = re.compile(r"[A-Za-z0-9_.\-]+")
# where a key, a flag or a query key may stand: each consumes its key possessively and stops
# at its separator, so the value is read by `_value` for a secret's key only and the search
# goes on inside it (`x=password=…`)
_KEYED = re.compile(
    r"(?<![\w.\-])([A-Za-z0-9_.\-]++)"
    r"(?:[\"']\]?+[ \t]*+(=>|:=|::|=|:|(?=[\"']))|\]?+[ \t]*+(=>|:=|::|=|:))"
    r"[ \t]*+(?:(?i:" + "|".join(sorted(SCHEME_WORDS)) + r")[ \t]++)?+"
)
_FLAG = re.compile(r"(?<![\w\-])--?([A-Za-z0-9_.][A-Za-z0-9_.\-]*+)(=|[ \t]++)")
_QUERY_KEY = re.compile(r"(?<=[?&;#])([A-Za-z0-9_.\-]++)=")
_BEARER = re.compile(
    r"(?<![A-Za-z0-9])[Bb][Ee][Aa][Rr][Ee][Rr][ \t]++([A-Za-z0-9\-._~+/]{16,}+=*+)"
)
_QUOTED = {
    '"': re.compile(r'"(?:[^"\\\n]|\\.)*"'),
    "'": re.compile(r"'[^'\n]*'"),
}
_BARE = re.compile(r"[^\s&;,'\"<>(){}\[\]]+")
_QUERY_VALUE = re.compile(r"[^&;#\s'\"<>]+")
_BLANKS = re.compile(r"[ \t]*")
_AWS_SECRET = re.compile(r"[ \t,:;=|'\"]{1,4}([A-Za-z0-9/+]{40})(?![A-Za-z0-9+=])")
_AWS_QUOTED = re.compile(r"[\"']([A-Za-z0-9/+]{40})[\"']")

TOKENS: tuple[tuple[Shape, re.Pattern], ...] = tuple(
    (Shape(name, example), re.compile(pattern))
    for name, example, pattern in (
        ("GitHub token", "[ghp_…36]", r"gh[pousr]_[A-Za-z0-9_]{30,}"),
        ("GitHub fine-grained token", "[github_pat_…]", r"github_pat_[A-Za-z0-9_]{20,}"),
        ("Hugging Face token", "[hf_…]", r"hf_[A-Za-z0-9]{30,}"),
        (
            "GitLab token",
            "[glpat-…]",
            r"gl(?:pat|dt|ft|soat|rt|cbt|imt|ptt|agent|oas)-[A-Za-z0-9_\-]{20,}",
        ),
        ("GitLab runner token", "[GR1348941…]", r"GR1348941[A-Za-z0-9_\-]{20,}"),
        ("OpenAI or Anthropic key", "[sk-…]", r"sk-[A-Za-z0-9_\-]{20,}"),
        ("Stripe key", "[sk_live_…]", r"[rs]k_(?:live|test)_[A-Za-z0-9]{16,}"),
        ("Slack token", "[xoxb-…]", r"[xX][oO][xX][abposrABPOSR]-[0-9]+-[A-Za-z0-9\-]+"),
        ("Databricks token", "[dapi…32 hex]", r"dapi[a-f0-9]{32}"),
        ("npm token", "[npm_…36]", r"npm_[A-Za-z0-9]{36}"),
        ("PyPI token", "[pypi-AgEI…]", r"pypi-Ag[A-Za-z0-9_\-]{70,}"),
        ("SendGrid key", "[SG.….…]", r"SG\.[A-Za-z0-9_\-]{22}\.[A-Za-z0-9_\-]{43}"),
        ("Square OAuth secret", "[sq0csp-…]", r"sq0csp-[0-9A-Za-z\\\-_]{43}"),
        ("Twilio key or account", "[SK…32]", r"(?:AC|SK)[a-z0-9]{32}(?![A-Za-z0-9])"),
        ("Artifactory key", "[AKC…]", r"AKC[A-Za-z0-9]{10,}(?![A-Za-z0-9])"),
        ("Artifactory password", "[AP…]", r"AP[0-9A-F][A-Za-z0-9]{8,}(?=[\s\"]|$)"),
        (
            "JSON Web Token",
            "[eyJ….eyJ….…]",
            r"eyJ[A-Za-z0-9_\-]+\.[A-Za-z0-9_\-]+(?:\.[A-Za-z0-9_\-+/=]*)?",
        ),
        (
            "Discord bot token",
            "[M….….…]",
            r"[MNO][A-Za-z0-9_\-]{23,25}\.[A-Za-z0-9_\-]{6}\.[A-Za-z0-9_\-]{27}",
        ),
        (
            "AWS key id and its secret",
            "[AKIA…16] [40 characters]",
            r"(?:A3T[A-Z0-9]|ABIA|ACCA|AKIA|ASIA)[0-9A-Z]{16}(?![A-Za-z0-9])",
        ),
    )
)
"""Token formats, masked wherever they stand after a character that is not a letter or digit:
each is a literal prefix and then character classes, repeated (one of them without bound)."""
_TOKEN_START = re.compile(
    r"(?<![A-Za-z0-9_\-.\\])(?:gh[pousr]_|github_pat_|hf_|gl(?:pat|dt|ft|soat|rt|cbt|imt|ptt|agent|oas)-|GR1348941"
    r"|sk-|[rs]k_|[xX][oO][xX]|dapi|npm_|pypi-|SG\.|sq0csp-|AC|SK|AKC|AP|eyJ|A3T|ABIA|ACCA"
    r"|AKIA|ASIA)"
)
_DISCORD = re.compile(
    r"(?<![A-Za-z0-9_\-.\\])[MNO][A-Za-z0-9_\-]{23,25}\.[A-Za-z0-9_\-]{6}\.[A-Za-z0-9_\-]{27}"
)
_TELEGRAM = re.compile(r"(?<![0-9])[0-9]{8,10}:[0-9A-Za-z_\-]{35}(?![0-9A-Za-z_\-])")
_MAILCHIMP = re.compile(r"(?<![0-9a-z])[0-9a-z]{32}-us[0-9]{1,2}(?![0-9])")
_SLACK_HOOK = "hooks.slack.com/services/"
_PEM_BEGIN, _PEM_END, _PEM_KIND = "-----BEGIN ", "-----END ", "PRIVATE KEY-----"

CATALOGUE: tuple[Shape, ...] = (
    Shape("a URI's userinfo", "scheme://[user:password]@host"),
    Shape("a query or fragment token", "https://h/x?X-Amz-Signature=[…]&a=1"),
    Shape(
        "a keyed value, any casing (snake, kebab, camel, Pascal, upper, dotted =)",
        "password=[…] · secretAccessKey: […] · 'SessionToken': '[…]' · AccountKey=[…]",
    ),
    Shape("an HTTP authorization header", "Authorization: Bearer […]"),
    Shape("a command line's secret flag", "--db-password=[…] · --api-key […]"),
    Shape("a bearer token on its own", "Bearer [16+ characters, a digit among them]"),
    Shape("a PEM private key block, over several writes too", "-----BEGIN … PRIVATE KEY-----[…]"),
    Shape("a Slack webhook", "https://hooks.slack.com/services/[…]"),
    Shape("a Telegram bot token", "[123456789:35 characters]"),
    Shape("a Mailchimp key", "[32 characters-us12]"),
    Shape("an AWS secret in quotes on a line that names AWS", "aws … '[40 characters]'"),
    *(shape for shape, _ in TOKENS),
)


# ----------------------------------------------------------------------------- the passes
def _userinfo(text: str, spans: list[tuple[int, int]]) -> None:
    """`scheme://user:password@host` → the userinfo: from `://` to the last `@` before the
    line ends or the next `://`."""
    at = text.find("://")
    ends = {"\n": -1, "\r": -1}
    while at != -1:
        nxt = text.find("://", at + 3)
        for stop_char, found in ends.items():
            if found < at:  # each line end found once, as `at` moves on (none: the text's end)
                found = text.find(stop_char, at)
                ends[stop_char] = len(text) if found == -1 else found
        stop = min(*ends.values(), nxt if nxt != -1 else len(text))
        last_at = text.rfind("@", at + 3, stop)
        if last_at != -1:
            spans.append((at + 3, last_at))
        at = nxt


def _pem(text: str, spans: list[tuple[int, int]]) -> None:
    """A private key block's body: after a `BEGIN … PRIVATE KEY` header (PEM's, PGP's
    `… PRIVATE KEY BLOCK`) to its END line or the end of the text; a PuTTY key file's from
    its first line on."""
    at = text.find("BEGIN ") if "PRIVATE KEY" in text else -1
    while at != -1:
        kind = text.find("PRIVATE KEY", at, at + 40)
        if kind == -1 or "\n" in text[at:kind]:
            at = text.find("BEGIN ", at + 6)
            continue
        body = kind + len("PRIVATE KEY")
        for tail in (" BLOCK", "-----", "\r", "\n"):
            if text.startswith(tail, body):
                body += len(tail)
        end = text.find("END ", body)
        if end == -1:
            spans.append((body, len(text)))
            return
        stop = end
        while stop > body and text[stop - 1] == "-":  # the END line's dashes kept
            stop -= 1
        spans.append((body, stop))
        at = text.find("BEGIN ", end)
    putty = text.find("PuTTY-User-Key-File-") if "PuTTY" in text else -1
    if putty != -1:
        spans.append((putty + len("PuTTY-User-Key-File-"), len(text)))


def _value(text: str, pos: int) -> tuple[int, int] | None:
    """The value at `pos`: quoted (the span inside its quotes), or bare."""
    if pos >= len(text):
        return None
    quote = _QUOTED.get(text[pos])
    if quote is not None:
        m = quote.match(text, pos)
        if m is None:  # never closed on its line: the rest of the line
            end = len(text)
            for stop in ("\n", "\r"):
                found = text.find(stop, pos)
                end = min(end, found) if found != -1 else end
            return (pos + 1, end) if end > pos + 1 else None
        return (pos + 1, m.end() - 1) if m.end() - 1 > pos + 1 else None
    m = _BARE.match(text, pos)
    return (pos, m.end()) if m else None


def _runs(text: str, low: str, spans: list[tuple[int, int]]) -> None:
    """Keyed values, secret flags, query tokens and bearer tokens (`low`: `text.lower()`)."""
    if _STEM_GATE.search(low):
        done = 0
        queried = "=" in text and _QUERY_MARKS.search(text) is not None
        for m in _QUERY_KEY.finditer(text) if queried else ():
            if m.start() >= done and m.group(1).lower() in QUERY_KEYS:
                v = _QUERY_VALUE.match(text, m.end())
                if v:
                    spans.append(v.span())
                    done = v.end()
        done = 0
        for m in _KEYED.finditer(text) if ("=" in text or ":" in text) else ():
            if m.start() < done:
                continue  # inside a value masked already
            key = m.group(1)
            kind = _secret_key(key)
            if not kind:
                continue
            sep = m.group(2) if m.group(2) is not None else m.group(3)
            if sep != "=" and (
                "." in key or text.startswith("//", m.end(2 if m.group(2) is not None else 3))
            ):
                continue
            done = _take(text, m.end(), kind, spans) or done
        done = 0
        for m in _FLAG.finditer(text) if "-" in text else ():
            if m.start() < done:
                continue
            kind = _secret_key(m.group(1))
            if kind:
                done = _take(text, m.end(), kind, spans) or done
    if "bearer" in low:
        for m in _BEARER.finditer(text):
            if any(c.isdigit() for c in m.group(1)):
                spans.append(m.span(1))


def _take(text: str, at: int, kind: str, spans: list[tuple[int, int]]) -> int:
    """Masks the value at `at` for a key of `kind`; returns where it ends (0: none)."""
    value = _value(text, at)
    if value and (kind == "strong" or value[1] - value[0] >= WEAK_MIN):
        spans.append(value)
        return value[1]
    return 0


def _first_chars(parsed) -> set[str]:
    """The characters a parsed pattern can start with: which patterns a prefix hit tries."""
    from re import _constants as c

    op, av = next(iter(parsed))
    if op is c.LITERAL:
        return {chr(av)}
    if op is c.IN:
        found: set[str] = set()
        for kind, value in av:
            if kind is c.LITERAL:
                found.add(chr(value))
            elif kind is c.RANGE:
                found.update(chr(x) for x in range(value[0], value[1] + 1))
        return found
    if op is c.SUBPATTERN:
        return _first_chars(av[3])
    if op is c.BRANCH:
        return set().union(*(_first_chars(branch) for branch in av[1]))
    raise ValueError(f"a token pattern starts with {op}: give it a literal prefix")


def _by_first() -> dict[str, list[tuple[Shape, re.Pattern]]]:
    from re import _parser

    table: dict[str, list[tuple[Shape, re.Pattern]]] = {}
    for shape, pattern in TOKENS:
        for first in _first_chars(_parser.parse(pattern.pattern)):
            table.setdefault(first, []).append((shape, pattern))
    return table


_BY_FIRST = _by_first()


def _tokens(text: str, low: str, spans: list[tuple[int, int]]) -> None:
    done = 0
    for m in _TOKEN_START.finditer(text):
        pos = m.start()
        if pos < done:
            continue
        for shape, pattern in _BY_FIRST.get(text[pos], ()):
            t = pattern.match(text, pos)
            if t is None:
                continue
            spans.append(t.span())
            done = t.end()
            if shape.name.startswith("AWS"):
                secret = _AWS_SECRET.match(text, t.end())
                if secret:
                    spans.append((t.end(), secret.end()))
                    done = secret.end()
            break
    if len(text) >= 59 and text.count(".") >= 2:  # Discord's: not tried at every capital
        spans.extend(t.span() for t in _DISCORD.finditer(text))
    if ":" in text:
        spans.extend(t.span() for t in _TELEGRAM.finditer(text))
    if "-us" in text:
        spans.extend(t.span() for t in _MAILCHIMP.finditer(text))
    at = low.find(_SLACK_HOOK)
    while at != -1:
        v = _QUERY_VALUE.match(text, at + len(_SLACK_HOOK))
        if v:
            spans.append(v.span())
        at = low.find(_SLACK_HOOK, v.end() if v else at + 1)
    if "aws" in low:
        spans.extend(s.span(1) for s in _AWS_QUOTED.finditer(text))


def _spans(text: str) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    _pem(text, spans)
    if "://" in text:
        _userinfo(text, spans)
    low = text.lower()
    _runs(text, low, spans)
    _tokens(text, low, spans)
    return spans


def _mask_str(text: str) -> str:
    spans = _spans(text)
    if not spans:
        return text
    out, at = [], 0
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    for start, end in merged:
        out.append(text[at:start])
        out.append(MASK)
        at = end
    out.append(text[at:])
    return "".join(out)


def redact(value: Any) -> Any:
    """`value` with every credential in it masked (strings; containers recursively)."""
    if isinstance(value, str):
        return _mask_str(value)
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value


def contains_secret(text: str) -> bool:
    """Whether the matcher finds a credential in `text` (masked already or not)."""
    return bool(_spans(text))


class RedactingStream:
    """A text stream (stdout, stderr) that masks credentials in what is written to it: the
    console's boundary, for rayacc's own lines and for any library's. It masks whole lines
    (ended by a line feed or a carriage return): a URI written in pieces is masked as one.
    A partial line waits for its end, or for `release()` (the CLI calls it when the command
    ends); one longer than `MAX_LINE` characters is masked and written as it stands. A PEM
    private key block is held from its BEGIN line to its END line, so a key written over
    several writes is masked whole."""

    MAX_LINE = 1 << 20
    MAX_KEY = 1 << 16
    """A key block held longer than this is not a key's: what was held is masked (the whole of
    it, from the BEGIN line) and the rest of the block dropped up to its END line."""

    def __init__(self, stream):
        self._stream = stream
        self._partial = ""
        self._dropping = False

    def write(self, text: str) -> int:
        if not text:
            return 0
        if not self._partial and not self._dropping and text[-1] == "\n" and _PEM_BEGIN not in text:
            self._stream.write(_mask_str(text))  # whole lines, no key block: the common write
            return len(text)
        pending = self._partial + text
        if self._dropping:
            end = pending.find(_PEM_END)
            if end == -1:  # keep a tail: the END line may come in two writes
                self._partial = pending[-len(_PEM_END) :]
                return len(text)
            self._dropping = False
            pending = pending[end:]
        cut = max(pending.rfind("\n"), pending.rfind("\r")) + 1
        if cut == 0 and len(pending) > self.MAX_LINE:
            cut = len(pending)
        begin = pending.rfind(_PEM_BEGIN, 0, cut or len(pending))
        if begin != -1 and pending.find(_PEM_END, begin) == -1:
            # a key block still open: held from its BEGIN line until its END line
            if len(pending) - begin <= self.MAX_KEY:
                cut = begin
            else:
                self._emit(pending)  # masked from its BEGIN line on
                self._partial, self._dropping = "", True
                return len(text)
        self._partial = pending[cut:]
        if cut:
            self._emit(pending[:cut])
        return len(text)

    def write_data(self, text: str) -> int:
        """Writes what a command was asked to show (a job's logs, Ray's records included),
        masked like any line; a console stream that drops Ray's records keeps this."""
        return RedactingStream.write(self, text)

    def _emit(self, lines: str) -> None:
        self._stream.write(_mask_str(lines))

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


def catalogue_table() -> str:
    """`CATALOGUE` as the README's Markdown table."""
    rows = [f"| {shape.name} | `{shape.example}` |" for shape in CATALOGUE]
    return "\n".join(["| shape | masked (in brackets) |", "|---|---|", *rows])
