"""What the credential matcher masks, generated: secret keys in every casing and format (and the
words and paths it must leave alone, rayacc's own config paths among them), every shape of
detect-secrets' catalogue (samples drawn from its plugins' own patterns, kept only where its
plugin flags them), and the README's security section, which is `redact.CATALOGUE`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rayacc
from rayacc.redact import CATALOGUE, KEY_QUALIFIERS, SECRET_WORDS, contains_secret, redact

VALUE = "Zq9xK2mP7vL4nR8s"


def styles(words: list[str]) -> dict[str, str]:
    """One key's words in every casing a config, a program or a cloud writes."""
    return {
        "snake": "_".join(words),
        "kebab": "-".join(words),
        "camel": words[0] + "".join(w.title() for w in words[1:]),
        "pascal": "".join(w.title() for w in words),
        "upper": "_".join(words).upper(),
        "prefixed upper": "MY_APP_" + "_".join(words).upper(),
    }


SECRET_KEYS = sorted(
    {key for word in SECRET_WORDS for key in styles(["db", word]).values()}
    | {key for q in KEY_QUALIFIERS for key in styles([q, "key"]).values()}
    | set(styles(["secret", "access", "key"]).values())
    | set(styles(["session", "token"]).values())
)
FORMATS = {
    "key=value": "{k}={v}",
    "key: value": "{k}: {v}",
    "JSON": '{{"{k}": "{v}", "n": 1}}',
    "YAML": "  {k}: {v}\n",
    "Python repr": "{{'{k}': '{v}'}}",
    "header": "{k}: Bearer {v}",
    "command line": "tool --{k} {v} --x 1",
    "command line =": "tool --{k}={v}",
    "dotted override": "model.kwargs.{k}={v}",
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_secret_key_in_every_casing_and_format_is_masked(fmt):
    missed = []
    for key in SECRET_KEYS:
        text = FORMATS[fmt].format(k=key, v=VALUE)
        if VALUE in redact(text) or not contains_secret(text):
            missed.append(text)
    assert not missed, missed[:10]


def _config_paths() -> list[str]:
    from pydantic import BaseModel

    from rayacc.config import TrainConfig

    paths = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            path = f"{prefix}{name}"
            paths.append(path)
            kind = field.annotation
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                walk(kind, path + ".")

    walk(TrainConfig, "")
    return paths


LEFT_ALONE = [
    *(f"  - {path}: unknown key. Fix: did you mean {path}?" for path in _config_paths()),
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "max_tokens=5",
    "max_new_tokens: 200",
    "--key-path /etc/x",
    "author=me",
    "keyboard: yes",
    "monkey=1",
    "the passage: 3",
    "secretary=no",
    "Pass: 2/5",
    "key: x",
    '{"key": "value"}',
    "AccessKeyId: later",
    "tokens 200, passes 3, keys 4",
    "checkpoint_step00000004_attempt2",
    "sha256 " + "ab" * 32,
    "git 0123456789abcdef0123456789abcdef01234567",
]


@pytest.mark.parametrize("text", LEFT_ALONE)
def test_what_is_not_a_secret_is_left_as_written(text):
    assert redact(text) == text and not contains_secret(text)


# ----------------------------------------------------------------------- detect-secrets
ds = pytest.importorskip("detect_secrets")
NOT_CREDENTIALS = {
    "IPPublicDetector": "an address is not a credential",
    "SoftlayerDetector[1]": "a 64-hex path segment is how a SHA-256 digest reads",
}
"""detect-secrets' shapes the matcher leaves alone, and why."""
KEYWORD_FORMS = {
    "CloudantDetector",
    "IbmCloudIamDetector",
    "IbmCosHmacDetector",
    "SoftlayerDetector",
}
"""Keyword detectors that also take a key and its value apart by spaces alone (`cl_key 0f…`):
prose reads so (`token expired at …`), so only their `=`, `:`, `=>`, `::` and quoted forms are
masked."""


def _plugins():
    import importlib
    import inspect
    import pkgutil

    from detect_secrets import plugins
    from detect_secrets.plugins.base import RegexBasedDetector

    for info in pkgutil.iter_modules(plugins.__path__):
        module = importlib.import_module(f"detect_secrets.plugins.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if (
                issubclass(cls, RegexBasedDetector)
                and cls is not RegexBasedDetector
                and not inspect.isabstract(cls)
            ):
                for i, pattern in enumerate(cls().denylist):
                    name = f"{cls.__name__}[{i}]"
                    if name not in NOT_CREDENTIALS and cls.__name__ not in NOT_CREDENTIALS:
                        yield name, cls, pattern


PLUGINS = {name: (cls, pattern) for name, cls, pattern in _plugins()}


def test_the_catalogue_is_read_from_detect_secrets():
    assert len(PLUGINS) >= 25
    assert {"AWSKeyDetector[0]", "AzureStorageKeyDetector[0]", "StripeDetector[0]"} <= set(PLUGINS)


@pytest.mark.parametrize("name", sorted(PLUGINS))
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_shape_detect_secrets_knows_is_masked(name, data):
    cls, pattern = PLUGINS[name]
    ascii_only = re.compile(
        pattern.pattern, (pattern.flags & ~re.UNICODE) | re.ASCII
    )  # ASCII secrets
    sample = data.draw(
        st.from_regex(ascii_only, fullmatch=True).filter(lambda s: s.isascii() and s.isprintable())
    )
    line = f"log: {sample} end"
    flagged = cls().analyze_line(filename="x.log", line=line)
    if not flagged:
        return  # its plugin's own checks refuse the draw (a JWT that does not decode, …)
    secrets = {s.secret_value for s in flagged if s.secret_value}
    found = pattern.search(line)
    if found and found.groups() and found.group(1) and cls.__name__ in KEYWORD_FORMS:
        between = line[max(0, found.start(1) - 12) : found.start(1)]
        if not re.search(r"[=:]|[\"'][ \t]*[\"']", between):
            return  # a key and its value apart by spaces only: prose reads so (KEYWORD_FORMS)
    masked = redact(line)
    assert contains_secret(line), line
    if cls.__name__ == "PrivateKeyDetector":  # it flags the header: what follows is masked
        assert masked.endswith("***"), (line, masked)
        return
    assert not [s for s in secrets if len(s) >= 8 and s in masked], (line, masked)


def test_a_real_jwt_and_a_pem_block_are_masked():
    import base64

    def part(obj) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")

    jwt = f"{part({'alg': 'HS256'})}.{part({'sub': '1234567890'})}.c2lnbmF0dXJlX2J5dGVz"
    assert jwt not in redact(f"header {jwt} trailer")
    pem = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END PRIVATE KEY-----"
    assert "MIIEvQ" not in redact(pem)


# ----------------------------------------------------------------------- the README
def test_the_readme_says_what_is_masked_as_the_code_lists_it():
    readme = (Path(rayacc.__file__).parents[1] / "README.md").read_text()
    section = readme.split("<!-- masked: generated from rayacc.redact.CATALOGUE -->")[1]
    section = section.split("<!-- /masked -->")[0]
    rows = re.findall(r"^\| (.+?) \| `(.+?)` \|$", section, re.M)
    assert rows == [(shape.name, shape.example) for shape in CATALOGUE], (
        "the README's table is not CATALOGUE: regenerate it with "
        "`python -c 'import rayacc.redact as r; print(r.catalogue_table())'`"
    )
