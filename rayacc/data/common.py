"""What the data modules share: the one error, the bundled datasets' names and the keys rayacc
keeps in a token Parquet's metadata (beneath sources, bundled, saved datasets and prepare)."""

from __future__ import annotations

__all__ = [
    "BUNDLED",
    "CHAT_KEY",
    "MASK_RULE_KEY",
    "ORIGIN_KEY",
    "TOKENIZER_KEY",
    "VOCAB_KEY",
    "VOCAB_SIZE_KEY",
    "DataError",
]

BUNDLED = ("digits", "shakespeare", "chat")
VOCAB_KEY = b"rayacc.vocab"
VOCAB_SIZE_KEY = b"rayacc.vocab_size"
"""Token files: the tokenizer's vocabulary size (ids may stop short of it)."""
TOKENIZER_KEY = b"rayacc.tokenizer"
"""Token files of `rayacc data prepare`: `bytes`, or the tokenizer.json it used (data/vocab.py)."""
CHAT_KEY = b"rayacc.chat"
"""Instruction data from a transformers tokenizer: its chat set-up as JSON (`chat_template`,
the special tokens, the template's end of turn), for an export a chat user loads."""
MASK_RULE_KEY = b"rayacc.mask_rule"
"""Instruction data: what its `loss_mask` counts (`answers` or `all`)."""
CUT_KEY = b"rayacc.cut"
"""Instruction data: the cut it was prepared with, as JSON (`seq_len`, the examples cut and the
answers' counted tokens they lost), checked against the job's `data.seq_len` at launch."""
ORIGIN_KEY = b"rayacc.origin"
"""Where the rows came from (a corpus, a tokenizer), in words."""


class DataError(ValueError):
    """A data source that cannot be used: names the file or field and the fix."""
