"""How a token run's ids read as text: the vocabulary its data was written with, found in the
Parquet metadata on the driver and carried by every checkpoint of the run (`vocab.json`), so
that `rayacc sample` decodes with the run's own vocabulary wherever the data went.

Kinds: `chars` (a character-level corpus: the bundled Shakespeare; id = index into `chars`),
`bytes` (`rayacc data prepare` without a tokenizer: ids 0..255 are UTF-8 bytes, 256 ends a
document), `tokenizer` (the tokenizer.json `data prepare --tokenizer` used, kept whole) and
`ids` (a user's own token Parquet: no text known, ids are shown as numbers).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from rayacc.data.common import CHAT_KEY, ORIGIN_KEY, TOKENIZER_KEY, VOCAB_SIZE_KEY, DataError
from rayacc.data.sources import DatasetInfo, schema_metadata

__all__ = ["BYTES", "BYTE_EOD", "EOD_TOKEN", "VOCAB_FILE", "Vocabulary"]

VOCAB_FILE = "vocab.json"
"""A checkpoint's vocabulary (token runs)."""
BYTES = b"bytes"
"""The TOKENIZER_KEY value of byte-level data."""
BYTE_EOD = 256
"""Byte-level data: the id that ends a document."""
EOD_TOKEN = "<|endoftext|>"
"""Its name in an exported tokenizer (GPT-2's)."""


def _byte_symbols() -> list[str]:
    """GPT-2's printable character for each byte 0..255 (the byte-level tokenizers' alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


@dataclass(frozen=True)
class Vocabulary:
    kind: str
    """`chars`, `bytes`, `tokenizer` or `ids` (module docstring)."""
    size: int = 0
    chars: str = ""
    tokenizer_json: str = ""
    chat: str = ""
    """A chat tokenizer's set-up (JSON: `chat_template`, `bos_token`, `eos_token`,
    `pad_token`, `end_of_turn`), where the data was rendered by one."""

    # ------------------------------------------------------------------ where it comes from
    @classmethod
    def of_data(
        cls, info: DatasetInfo, metadata: dict[bytes, bytes] | None = None
    ) -> Vocabulary | None:
        """The vocabulary of a token source (None for classification data); `metadata`: its
        schema's, where the caller read it already."""
        if info.format != "tokens":
            return None
        if info.vocab:
            return cls("chars", len(info.vocab), chars=info.vocab)
        meta = schema_metadata(info.path) if metadata is None else metadata
        tokenizer = meta.get(TOKENIZER_KEY)
        # data prepared before the tokenizer was recorded says so in its origin
        if tokenizer == BYTES or meta.get(ORIGIN_KEY) == b"byte-level":
            return cls("bytes", info.vocab_size)
        if tokenizer:
            chat = meta.get(CHAT_KEY, b"").decode("utf-8")
            return cls("tokenizer", info.vocab_size, tokenizer_json=tokenizer.decode("utf-8"),
                       chat=chat)  # fmt: skip
        size = int(meta[VOCAB_SIZE_KEY]) if VOCAB_SIZE_KEY in meta else info.vocab_size
        return cls("ids", size)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def well_formed(self) -> bool:
        """Whether a vocabulary read back (a checkpoint's `vocab.json`) is one rayacc writes."""
        return (
            self.kind in ("chars", "bytes", "tokenizer", "ids")
            and type(self.size) is int
            and self.size >= 0
            and isinstance(self.chars, str)
            and isinstance(self.tokenizer_json, str)
            and isinstance(self.chat, str)
        )

    def chat_setup(self) -> dict[str, str | None]:
        """The chat set-up the data was rendered with ({} where none): each entry text."""
        try:
            raw = json.loads(self.chat) if self.chat else {}
        except ValueError:
            return {}
        keys = ("chat_template", "bos_token", "eos_token", "pad_token", "end_of_turn")
        if not isinstance(raw, dict):
            return {}
        return {k: raw[k] for k in keys if isinstance(raw.get(k), str) and raw[k]}

    @classmethod
    def from_json(cls, text: str) -> Vocabulary:
        return cls(**json.loads(text))

    def describe(self) -> str:
        return {
            "chars": f"{self.size} characters",
            "bytes": "byte-level (UTF-8 bytes and an end-of-document id)",
            "tokenizer": f"the run's tokenizer.json ({self.size} ids)",
            "ids": f"{self.size} token ids with no recorded text",
        }[self.kind]

    # ------------------------------------------------------------------ text ↔ ids
    def encode(self, text: str) -> list[int]:
        """DataError naming what the vocabulary cannot encode."""
        if self.kind == "chars":
            lookup = {c: i for i, c in enumerate(self.chars)}
            missing = sorted({c for c in text if c not in lookup})
            if missing:
                named = ", ".join(repr(c) for c in missing)
                raise DataError(
                    f"--prompt: the character{'s' if len(missing) > 1 else ''} {named} "
                    f"{'are' if len(missing) > 1 else 'is'} not in the run's vocabulary of "
                    f"{len(self.chars)} characters ({self.chars!r}). Fix: use those characters"
                )
            return [lookup[c] for c in text]
        if self.kind == "bytes":
            return list(text.encode("utf-8"))
        if self.kind == "tokenizer":
            return self._tokenizer().encode(text, add_special_tokens=False).ids
        try:
            ids = [int(t) for t in text.split()]
        except ValueError:
            raise DataError(
                "--prompt: this run's data records no vocabulary (token ids only), so the "
                "prompt is token ids. Fix: give them as numbers, e.g. --prompt '12 7 301'"
            ) from None
        outside = [i for i in ids if not 0 <= i < self.size]
        if outside:
            raise DataError(
                f"--prompt: token id{'s' if len(outside) > 1 else ''} "
                f"{', '.join(map(str, outside[:5]))} outside the run's {self.size} ids. Fix: "
                f"give ids in 0..{self.size - 1}"
            )
        return ids

    def decode(self, ids: list[int]) -> str:
        if self.kind == "chars":
            return "".join(self.chars[i] for i in ids)
        if self.kind == "bytes":
            out, run = [], bytearray()
            for i in ids:
                if i == BYTE_EOD:
                    out.append(run.decode("utf-8", errors="replace") + "\n\n")
                    run = bytearray()
                else:
                    run.append(i)
            return "".join(out) + run.decode("utf-8", errors="replace")
        if self.kind == "tokenizer":
            return self._tokenizer().decode(ids, skip_special_tokens=False)
        return " ".join(map(str, ids))

    def start(self) -> list[int]:
        """The prompt when none is given: a line break, or the first id."""
        if self.kind == "chars":
            return [self.chars.index("\n")] if "\n" in self.chars else [0]
        if self.kind == "bytes":
            return [BYTE_EOD]
        if self.kind == "tokenizer":
            return self.encode("\n") or [0]
        return [0]

    def hf_tokenizer(self):
        """A `tokenizers.Tokenizer` that encodes text to this vocabulary's ids (what `rayacc
        export` writes for `AutoTokenizer`), or None where the data records ids only."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        if self.kind == "tokenizer":
            return self._tokenizer()
        if self.kind == "chars":
            # each character a token, no merges: id = index into the run's characters
            tok = Tokenizer(models.BPE({c: i for i, c in enumerate(self.chars)}, merges=[]))
            tok.decoder = decoders.Fuse()
            return tok
        if self.kind == "bytes":
            # byte b is id b under GPT-2's printable stand-ins for bytes; 256 ends a document
            vocab = {c: b for b, c in enumerate(_byte_symbols())}
            vocab[EOD_TOKEN] = BYTE_EOD
            tok = Tokenizer(models.BPE(vocab, merges=[]))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
            tok.decoder = decoders.ByteLevel()
            tok.add_special_tokens([EOD_TOKEN])
            return tok
        return None

    def _tokenizer(self):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(
                "this run's data was tokenized with a tokenizer.json: decoding needs the "
                "`tokenizers` package (pip install tokenizers)"
            ) from None
        return Tokenizer.from_str(self.tokenizer_json)
