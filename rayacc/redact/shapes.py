"""The second net: the shapes a credential takes where no origin announced it (`CATALOGUE`; the
README's security section is made from it), found in one pass each, linear by construction
(tests/unit/package/test_redact_linear.py reads every pattern here)."""

from __future__ import annotations

import re

from rayacc.redact.keys import (
    _QUERY_MARKS,
    _STEM_GATE,
    DOTTED_WORDS,
    QUERY_KEYS,
    SCHEME_WORDS,
    WEAK_MIN,
    Shape,
    secret_key,
)

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
        ("Google API key", "[AIza…35]", r"AIza[0-9A-Za-z_\-]{35}"),
        ("Google OAuth access token", "[ya29.…]", r"ya29\.[0-9A-Za-z_\-]{20,}"),
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
    # after a character that is not part of a token, or after an escape (`\n` in JSON) or a
    # percent-encoded character (`%3D`)
    r"(?:(?<![A-Za-z0-9_\-.\\])|(?<=\\[ntr])|(?<=%[0-9A-Fa-f]{2}))"
    r"(?:gh[pousr]_|github_pat_|hf_|gl(?:pat|dt|ft|soat|rt|cbt|imt|ptt|agent|oas)-|GR1348941"
    r"|sk-|[rs]k_|[xX][oO][xX]|dapi|npm_|pypi-|SG\.|sq0csp-|AC|SK|AKC|AP|eyJ|A3T|ABIA|ACCA"
    r"|AKIA|ASIA|AIza|ya29\.)"
    # GitHub's and GitLab's prefixes name nothing else: also inside a name (`nightly-ghp_…`,
    # a run's name), after a separator
    r"|(?<![A-Za-z0-9])(?:gh[pousr]_|github_pat_|gl(?:pat|dt|ft|soat|rt|cbt|imt|ptt|agent|oas)-)"
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
    Shape("a braced or bracketed value", "Pwd={[…]} · password: [[…]]"),
    Shape("a YAML value on the lines below its key", "password: | ⏎ [  …]"),
    Shape("a command's password", "curl -u user:[…] · sshpass -p […] · mysql -p[…]"),
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


def _line_end(text: str, pos: int, stop: int | None = None) -> int:
    """Where the line at `pos` ends (searched up to `stop`: `stop` when it goes on)."""
    stop = len(text) if stop is None else stop
    ends = [e for e in (text.find("\n", pos, stop), text.find("\r", pos, stop)) if e != -1]
    return min(ends) if ends else stop


def _block(text: str, at: int) -> tuple[int, int] | None:
    """A YAML value on the lines below its key (`password: |` or `password:` at the line's
    end): the lines indented deeper than the key's, from the first one's text on. Only the
    characters at `at` decide whether there is one (the search stays linear)."""
    pos = at
    if pos < len(text) and text[pos] in "|>":
        pos += 1
        while pos < len(text) and text[pos] in "-+0123456789":
            pos += 1
        while pos < len(text) and text[pos] in " \t":
            pos += 1
    if pos >= len(text) or text[pos] not in "\r\n":
        return None
    line_start = max(text.rfind("\n", 0, at), text.rfind("\r", 0, at)) + 1
    head = text[line_start:at]
    indent = len(head) - len(head.lstrip(" "))
    first = last = None
    pos += 2 if text.startswith("\r\n", pos) else 1
    while pos < len(text):
        end = _line_end(text, pos)
        line = text[pos:end]
        body = line.lstrip(" ")
        if body and len(line) - len(body) <= indent:
            break
        if body.strip():
            first = pos + len(line) - len(body) if first is None else first
            last = end
        pos = end + 1
    return (first, last) if first is not None and last is not None else None


def _value(text: str, pos: int) -> tuple[int, int] | None:
    """The value at `pos`: quoted (the span inside its quotes), or bare."""
    if pos >= len(text):
        return None
    if text[pos] in "{[":  # ODBC's braced value (`}}` is a brace inside it), a bracketed one
        close_char = "}" if text[pos] == "{" else "]"
        end = pos + 1
        while True:
            close = text.find(close_char, end)
            if close != -1 and _line_end(text, pos, close) < close:
                close = -1  # closed on a later line only: the value is the rest of its line
            if close == -1:
                line_end = _line_end(text, pos)
                return (pos + 1, line_end) if line_end > pos + 1 else None
            if close_char == "}" and text.startswith("}}", close):
                end = close + 2
                continue
            return (pos + 1, close) if close > pos + 1 else None
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
                if text.startswith(("{", "["), m.end()):  # ODBC's `Pwd={…}`
                    braced = _value(text, m.end())
                    if braced:
                        spans.append(braced)
                        done = braced[1]
                    continue
                v = _QUERY_VALUE.match(text, m.end())
                if v:
                    spans.append(v.span())
                    done = v.end()
        done = 0
        for m in _KEYED.finditer(text) if ("=" in text or ":" in text) else ():
            if m.start() < done:
                continue  # inside a value masked already
            key = m.group(1)
            kind = secret_key(key)
            if not kind:
                continue
            sep = m.group(2) if m.group(2) is not None else m.group(3)
            if sep != "=" and (
                ("." in key and not _dotted_secret(key))
                or text.startswith("//", m.end(2 if m.group(2) is not None else 3))
            ):
                continue
            done = _take(text, m.end(), kind, spans) or done
        done = 0
        for m in _FLAG.finditer(text) if "-" in text else ():
            if m.start() < done:
                continue
            kind = secret_key(m.group(1))
            if kind:
                done = _take(text, m.end(), kind, spans) or done
    _commands(text, low, spans)
    if "bearer" in low:
        for m in _BEARER.finditer(text):
            if any(c.isdigit() for c in m.group(1)):
                spans.append(m.span(1))


_CURL_USER = re.compile(r"(?<![\w\-])(?:-u|--user)(?:[ \t]++|=)['\"]?+[^\s'\":]++:([^\s'\"]++)")
PASSWORD_FLAGS = {"sshpass": ("-p",), "mysql": ("-p",), "mariadb": ("-p",),
                  "mysqldump": ("-p",), "mysqladmin": ("-p",)}  # fmt: skip
"""Commands whose short flag takes a password (sshpass's `-p PW`, mysql's attached `-pPW`)."""


def _commands(text: str, low: str, spans: list[tuple[int, int]]) -> None:
    """A command line's password: curl's `-u user:PW`, and the flags of `PASSWORD_FLAGS` on
    the line of their command (one search a line: linear)."""
    if "-u" in text or "--user" in text:
        spans.extend(m.span(1) for m in _CURL_USER.finditer(text))
    for command, flags in PASSWORD_FLAGS.items():
        at = low.find(command)
        while at != -1:
            line_end = _line_end(text, at)
            for flag in flags:
                f = text.find(f" {flag}", at, line_end)
                if f == -1:
                    continue
                value = f + 1 + len(flag)
                attached = value < line_end and not text[value].isspace()
                if not attached and command == "sshpass":
                    value = (
                        len(text[:value])
                        + len(text[value:line_end])
                        - len(text[value:line_end].lstrip(" \t"))
                    )
                    attached = value < line_end
                if attached:
                    end = value
                    while end < line_end and not text[end].isspace():
                        end += 1
                    spans.append((value, end))
            at = low.find(command, line_end)


def _dotted_secret(key: str) -> bool:
    flat = key.rsplit(".", 1)[-1].lower().replace("_", "").replace("-", "")
    return flat.endswith(tuple(DOTTED_WORDS))


def _take(text: str, at: int, kind: str, spans: list[tuple[int, int]]) -> int:
    """Masks the value at `at` for a key of `kind`; returns where it ends (0: none)."""
    block = _block(text, at) if kind == "strong" else None
    if block is not None:
        spans.append(block)
        return block[1]
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


def credential_spans(text: str) -> list[tuple[int, int]]:
    """Where the shapes of `CATALOGUE` find a credential in `text` (the second net)."""
    spans: list[tuple[int, int]] = []
    _pem(text, spans)
    if "://" in text:
        _userinfo(text, spans)
    low = text.lower()
    _runs(text, low, spans)
    _tokens(text, low, spans)
    return spans
