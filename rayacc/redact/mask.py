"""Masking: a text's spans (the known values and the shapes), a value masked whole or in part."""

from __future__ import annotations

from typing import Any

from rayacc.redact.keys import MASK, WEAK_MIN, secret_key
from rayacc.redact.known import KNOWN, OWN
from rayacc.redact.shapes import CATALOGUE, credential_spans


def _spans(text: str) -> list[tuple[int, int]]:
    shaped = credential_spans(text)
    own = OWN.spans(text) if shaped else []
    if own:  # a pattern's match inside one of rayacc's own identifiers is none
        shaped = [(a, b) for a, b in shaped if not any(lo <= a and b <= hi for lo, hi in own)]
    return KNOWN.spans(text) + shaped


def _mask_str(text: str) -> str:
    return _apply(text, _spans(text))


def _apply(text: str, spans: list[tuple[int, int]]) -> str:
    """`text` with each span (merged where they touch) replaced by the mask."""
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
    """`value` with every credential in it masked (strings; containers recursively): a
    mapping's value under a key that names a secret is masked whole, whatever it holds."""
    if isinstance(value, str):
        return _mask_str(value)
    if isinstance(value, dict):
        return {k: _masked(v) if _names_secret(k, v) else redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value


def _names_secret(key: Any, value: Any) -> bool:
    kind = secret_key(key) if isinstance(key, str) else ""
    if kind == "strong":
        return True
    return kind == "weak" and isinstance(value, str) and len(value) >= WEAK_MIN


def _masked(value: Any) -> Any:
    """Every text in `value` masked whole (a secret's value; numbers and flags kept)."""
    if isinstance(value, str):
        return MASK if value else value
    if isinstance(value, dict):
        return {k: _masked(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_masked(v) for v in value)
    return value


def contains_secret(text: str) -> bool:
    """Whether the matcher finds a credential in `text` (masked already or not)."""
    return bool(_spans(text))


def catalogue_table() -> str:
    """`CATALOGUE` as the README's Markdown table."""
    rows = [f"| {shape.name} | `{shape.example}` |" for shape in CATALOGUE]
    return "\n".join(["| shape | masked (in brackets) |", "|---|---|", *rows])
