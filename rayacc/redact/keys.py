"""What names a secret: the words a key ends in (every casing and separator reads the same), the
query keys, the mask. The one list every reader of keys uses (`secret_key`)."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

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


DOTTED_WORDS = frozenset(
    w for w in SECRET_WORDS | {f"{q}key" for q in KEY_QUALIFIERS}
    if w not in ("token", "auth", "authorization", "signature")
)  # fmt: skip
"""The words a dotted key before a colon ends in to hold a secret (`spring.datasource.password:
x`): not `token` and its kin, which end config paths in rayacc's own messages
(`train.loss_chunk_token: unknown key`)."""
NOT_SECRETS = frozenset(
    f"{word}token" for word in ("bos", "eos", "pad", "unk", "sep", "cls", "mask", "additional")
)
"""Keys that end in a secret word and name no secret: a tokenizer's special tokens (`eos_token:
"</s>"` is text, not a credential)."""


@functools.lru_cache(maxsize=4096)
def secret_key(key: str) -> str:
    """'': not a secret's key; 'strong': its value is masked; 'weak': masked when long. The
    key's last dotted part, its `_` and `-` dropped, in lower case, ends with a secret word:
    every casing reads the same (`secretAccessKey`, `SECRET_ACCESS_KEY`, `secret-access-key`
    all end in `accesskey`), and a word inside another (`tokenizer`, `keyboard`, `author`)
    ends the key otherwise."""
    low = key.rsplit(".", 1)[-1].lower()
    if not any(stem in low for stem in _STEMS):
        return ""
    flat = low.replace("_", "").replace("-", "")
    if flat in NOT_SECRETS:
        return ""
    if flat.endswith(_STRONG_ENDS):
        return "strong"
    return "weak" if flat.endswith(_WEAK_ENDS) else ""
