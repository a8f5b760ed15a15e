"""Secrets known by where they come from, registered in this process's `KNOWN` before
anything is written or printed, then masked by exact value in every sink (`redact`): the
config's fields — a value at any depth under a key that names a secret (`keys.secret_key`:
every casing and separator of one list of words), the userinfo and credential query values of
a URI in any field — the environment's credential variables (`CREDENTIAL_VARIABLES`, and any
variable whose name names a secret), and the secrets inside a credentials file such a variable
names. The driver registers them where a config is read and when a command or fit starts; a
worker registers its run's when it starts (its config crossed the process boundary whole)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from rayacc.redact.keys import secret_key
from rayacc.redact.known import KNOWN
from rayacc.redact.shapes import credential_spans

__all__ = [
    "CREDENTIAL_FILES",
    "CREDENTIAL_VARIABLES",
    "register_config",
    "register_environment",
    "register_run",
    "secrets_of",
]

CREDENTIAL_VARIABLES = (
    # cloud storage and compute
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_CLIENT_SECRET",
    "GOOGLE_OAUTH_ACCESS_TOKEN",
    # tracking and registries
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "DATABRICKS_TOKEN",
    "DATABRICKS_CLIENT_SECRET",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "WANDB_API_KEY",
    "COMET_API_KEY",
    "NEPTUNE_API_TOKEN",
    "GITHUB_TOKEN",
    "GH_TOKEN",
    "GITLAB_TOKEN",
    "OPENAI_API_KEY",
    "ANTHROPIC_API_KEY",
    "RAY_AUTH_TOKEN",
    "PGPASSWORD",
    "MYSQL_PWD",
)
"""Environment variables whose value is a credential, by name; a variable not listed whose
name names a secret (`*_PASSWORD`, `*_TOKEN`, `*_SECRET_KEY`, …) counts too."""

NOT_CREDENTIAL_VARIABLES = frozenset({"PWD", "OLDPWD"})
"""Named like a secret (`pwd`) and none: the shell's working directories."""

CREDENTIAL_FILES = {
    "GOOGLE_APPLICATION_CREDENTIALS": "json",
    "AWS_SHARED_CREDENTIALS_FILE": "ini",
}
"""Variables that name a credentials file: its secret-named values are registered."""

MAX_FILE_BYTES = 1 << 20
"""A credentials file is a page of text: a larger one is not read."""


def _walk(value: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    """(key, leaf) for every leaf of a nested config value (its nearest key)."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _walk(v, str(k))
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _walk(v, key)
    else:
        yield key, value


def secrets_of(data: Any) -> set[str]:
    """The secrets a config (as a mapping, any depth) carries: each value under a key that
    names a secret (a long one for a weak word: `key`, `pass`), and every credential inside a
    string value (a URI's userinfo and its password, a credential query value, a keyed or
    token-shaped secret)."""
    found: set[str] = set()
    for key, leaf in _walk(data):
        kind = secret_key(key) if key else ""
        text = None if leaf is None or isinstance(leaf, bool) else str(leaf)
        if text is None:
            continue
        if kind == "strong" or (kind == "weak" and len(text) >= 16):
            found.add(text)
        for start, end in credential_spans(text):
            found.add(text[start:end])
            if text[max(0, start - 3) : start] == "://":
                # a userinfo's password alone: it may appear without its user elsewhere
                password = text[start:end].partition(":")[2]
                if password:
                    found.add(password)
    return found


def register_config(cfg: Any) -> None:
    """Registers the secrets of a config (a TrainConfig, or its mapping)."""
    data = cfg.model_dump(mode="json") if hasattr(cfg, "model_dump") else cfg
    for value in secrets_of(data):
        KNOWN.add(value)


def register_environment(environ: Mapping[str, str] | None = None) -> None:
    """Registers the environment's credentials: the listed variables', those whose name
    names a secret, credentials in a URI any variable holds, and the secret-named values of
    the credentials files `CREDENTIAL_FILES` name."""
    environ = os.environ if environ is None else environ
    for name, value in environ.items():
        if not value:
            continue
        if name in CREDENTIAL_VARIABLES or (
            secret_key(name) == "strong" and name not in NOT_CREDENTIAL_VARIABLES
        ):
            KNOWN.add(value)
        if "://" in value or "=" in value:
            for found in secrets_of({"": value}):
                KNOWN.add(found)
    for name, kind in CREDENTIAL_FILES.items():
        if environ.get(name):
            for found in _file_secrets(environ[name], kind):
                KNOWN.add(found)


def register_run(cfg: Any, streams: bool = False) -> None:
    """Everything a run's process must know before it writes: its config's secrets and its
    environment's. `streams`: this process's stdout and stderr mask them too (a worker's, which
    Ray writes to the node's log files and forwards to the driver)."""
    register_environment()
    register_config(cfg)
    if streams:
        import sys

        from rayacc.redact.stream import RedactingStream

        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if not isinstance(stream, RedactingStream):
                setattr(sys, name, RedactingStream(stream))


def _file_secrets(path: str, kind: str) -> set[str]:
    """The secret-named values of a credentials file (JSON: a service account key; INI: AWS's
    shared credentials); nothing where it cannot be read as one."""
    try:
        file = Path(path)
        if not file.is_file() or file.stat().st_size > MAX_FILE_BYTES:
            return set()
        text = file.read_text(errors="replace")
    except (OSError, ValueError):
        return set()
    if kind == "json":
        try:
            return secrets_of(json.loads(text))
        except ValueError:
            return set()
    pairs = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            pairs[key.strip()] = value.strip()
    return secrets_of(pairs)
