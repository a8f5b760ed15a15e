"""Credentials out of everything rayacc writes or prints: the one matcher every boundary uses
(console streams, files in run storage and checkpoints, PLAN.yaml and reports, MLflow, job
entrypoints, messages). A secret is known first by where it comes from: `KNOWN` (`known`), this
process's values registered by origin (`origins`: the config's secret-named and URI fields, the
environment's credential variables, the files they name), each masked by its exact value
wherever it appears. The shapes of `CATALOGUE` (`shapes`) are the second net, for a secret no
origin announced (a library echoing a token); `keys` says what names a secret; `stream` is the
console's boundary.

More: docs/design.md, "Notes from the code" (redact).
"""

from rayacc.redact.keys import (
    KEY_QUALIFIERS,
    MASK,
    QUERY_KEYS,
    SCHEME_WORDS,
    SECRET_WORDS,
    WEAK_WORDS,
    Shape,
    secret_key,
)
from rayacc.redact.known import KNOWN, OWN, OwnValues, SecretValues
from rayacc.redact.mask import catalogue_table, contains_secret, redact
from rayacc.redact.shapes import CATALOGUE, credential_spans
from rayacc.redact.stream import RedactingStream

__all__ = [
    "CATALOGUE",
    "KEY_QUALIFIERS",
    "KNOWN",
    "MASK",
    "OWN",
    "QUERY_KEYS",
    "SCHEME_WORDS",
    "SECRET_WORDS",
    "WEAK_WORDS",
    "OwnValues",
    "RedactingStream",
    "SecretValues",
    "Shape",
    "catalogue_table",
    "contains_secret",
    "credential_spans",
    "redact",
    "secret_key",
]
