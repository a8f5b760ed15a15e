"""Inspection of a Parquet source (a bundled dataset is prepared as one: data/bundled.py).

Formats (docs/design.md): classification rows hold `features` (list<float32>, fixed length) and
`label` (int64); token rows hold `tokens` (a list of integers of any width, length ≥ 2; uint16 or
int32 keeps files and reads small, batches are widened to int64) and, for instruction data, a
`loss_mask` beside them (a 0/1 per token: whether it counts as a target).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rayacc.config.features import DataKind
from rayacc.data.common import (
    BUNDLED,
    VOCAB_KEY,
    VOCAB_SIZE_KEY,
    DataError,
)

__all__ = [
    "DatasetInfo",
    "RowGroups",
    "Source",
    "describe_dataset",
    "read_source",
    "row_groups",
    "schema_metadata",
]


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
    num_row_groups: int = 0
    data_bytes: int = 0
    """Uncompressed size of the columns rayacc reads, from the Parquet metadata."""
    loss_mask: bool = False
    """Token rows carry a `loss_mask`: only the tokens it marks count as targets (loss items)."""
    documents: bool = False
    """Token rows carry `documents` (packed examples numbered per row: attention kept in each)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DatasetInfo:
        return cls(**d)


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


@dataclass(frozen=True)
class RowGroups:
    """The Parquet row groups of a source in row-id order: the units data is read in."""

    files: tuple[str, ...]
    """Paths on the source's filesystem (without the URI scheme)."""
    file: np.ndarray
    """Index into `files` of each row group."""
    index: np.ndarray
    """Row group index inside its file."""
    start: np.ndarray
    """Row id of each row group's first row."""
    size: np.ndarray

    def __len__(self) -> int:
        return len(self.size)

    def moved_to(self, file: str) -> RowGroups:
        """The same row groups in a copy of this one-file source at `file` (a path on the
        copy's filesystem)."""
        if len(self.files) != 1:
            raise ValueError(f"a copy of a source of {len(self.files)} files is not one file")
        return replace(self, files=(file,))


def row_groups(path: str) -> RowGroups:
    """The row groups of the Parquet source `path` (a resolved DatasetInfo.path), from the
    files' metadata only."""
    return _row_groups(_dataset(path))


def _row_groups(ds: pq.ParquetDataset) -> RowGroups:
    file, index, size = [], [], []
    for i, fragment in enumerate(ds.fragments):
        meta = fragment.metadata
        for g in range(meta.num_row_groups):
            file.append(i)
            index.append(g)
            size.append(meta.row_group(g).num_rows)
    sizes = np.array(size, dtype=np.int64)
    return RowGroups(
        tuple(f.path for f in ds.fragments),
        np.array(file, dtype=np.int32),
        np.array(index, dtype=np.int32),
        np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64),
        sizes,
    )


def _data_bytes(ds: pq.ParquetDataset, columns: set[str]) -> int:
    total = 0
    for fragment in ds.fragments:
        meta = fragment.metadata
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            for c in range(group.num_columns):
                column = group.column(c)
                if column.path_in_schema.split(".")[0] in columns:
                    total += column.total_uncompressed_size
    return total


def _fingerprint(ds: pq.ParquetDataset, counts: list[int]) -> str:
    infos = ds.filesystem.get_file_info([f.path for f in ds.fragments])
    files = [(Path(i.path).name, i.size, n) for i, n in zip(infos, counts, strict=True)]
    return hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]


MAX_IDS = 1 << 20
"""Largest class or token id count a dataset may imply without declaring it: above it the model
built for it (one output or embedding row per id) would be enormous, so a stray id is far more
likely than a real vocabulary."""

_SCAN_BATCH = 65_536


def _resolve(source: str, cache_dir: str | None, seq_len: int) -> str:
    if source in BUNDLED:
        from rayacc.data.bundled import prepare_bundled

        return str(prepare_bundled(source, cache_dir, seq_len))
    if _is_uri(source):
        return source
    p = Path(source).expanduser()
    if not p.exists():
        raise DataError(
            f"data.source={source!r}: no such file or folder. Fix: give an existing Parquet "
            f"path or URI, or a bundled name ({', '.join(BUNDLED)})"
        )
    if p.is_dir():
        from rayacc.data.saved_dataset import as_parquet, saved_dataset

        # a Hugging Face `datasets` folder (Arrow): its token rows as Parquet, once
        if (saved := saved_dataset(p)) is not None:
            from rayacc import env

            return str(as_parquet(saved, Path(cache_dir) if cache_dir else env.cache_dir()))
    return str(p.resolve())


def _batches(ds: pq.ParquetDataset, columns: list[str]):
    """(file, index of the batch's first row in the file, batch), streamed file by file."""
    for fragment in ds.fragments:
        first = 0
        for batch in fragment.to_batches(columns=columns, batch_size=_SCAN_BATCH):
            yield fragment.path, first, batch
            first += batch.num_rows


def _bad_row(path: str, row: int, problem: str, fix: str) -> DataError:
    return DataError(f"{path}, row {row}: {problem}. Fix: {fix}")


def _first(mask) -> int | None:
    """Index of the first true entry of a boolean array, or None."""
    index = pc.index(mask, True).as_py()
    return None if index < 0 else index


def _check_lists(path: str, first: int, col, what: str, fix: str) -> None:
    """No null list, no null entry in a list column's batch."""
    if col.null_count:
        row = first + _first(pc.is_null(col))
        raise _bad_row(path, row, f"`{what}` is null", fix)
    flat = pc.list_flatten(col)
    if flat.null_count:
        row = first + pc.list_parent_indices(col)[_first(pc.is_null(flat))].as_py()
        raise _bad_row(path, row, f"`{what}` holds a null entry", fix)


def _scan_classification(ds: pq.ParquetDataset) -> tuple[int, int]:
    """(features per row, classes) in one streamed pass; DataError with file and row for a
    null, a non-finite feature, a length that differs, or a label that is no class index."""
    width = None
    top = 0
    for path, first, batch in _batches(ds, ["features", "label"]):
        features, labels = batch.column("features"), batch.column("label")
        _check_lists(path, first, features, "features", "drop or fill the row")
        lengths = pc.list_value_length(features)
        width = width if width is not None else pc.min(lengths).as_py()
        other = _first(pc.not_equal(lengths, width))
        if other is not None:
            raise _bad_row(
                path,
                first + other,
                f"`features` has {lengths[other].as_py()} values where earlier rows have {width}",
                "give every row the same number of features",
            )
        flat = pc.list_flatten(features)
        if pa.types.is_floating(flat.type):
            bad = _first(pc.invert(pc.is_finite(flat)))
            if bad is not None:
                row = first + pc.list_parent_indices(features)[bad].as_py()
                raise _bad_row(path, row, "`features` holds NaN or Inf", "drop or fill the row")
        if labels.null_count:
            raise _bad_row(
                path, first + _first(pc.is_null(labels)), "`label` is null", "drop the row"
            )
        low = _first(pc.less(labels, 0))
        if low is not None:
            raise _bad_row(
                path,
                first + low,
                f"`label` is {labels[low].as_py()}",
                "labels are class indices >= 0",
            )
        big = _first(pc.greater_equal(labels, MAX_IDS))
        if big is not None:
            raise _bad_row(
                path,
                first + big,
                f"`label` is {labels[big].as_py()}, which would build a classifier of that many "
                "classes",
                f"labels are class indices 0..K-1 (K < {MAX_IDS:,})",
            )
        top = max(top, pc.max(labels).as_py())
    return int(width or 0), top + 1


def _scan_tokens(
    ds: pq.ParquetDataset, declared: int | None, extra: tuple[str, ...]
) -> tuple[int, int]:
    """(vocabulary size, longest row) in one streamed pass; DataError with file and row for a
    null, a row under 2 tokens, an id outside the vocabulary, or a `loss_mask` or `documents`
    that does not fit its tokens."""
    top, longest = 0, 0
    limit = declared or MAX_IDS
    for path, first, batch in _batches(ds, ["tokens", *extra]):
        tokens = batch.column("tokens")
        _check_lists(path, first, tokens, "tokens", "drop the row, or re-tokenize the text")
        lengths = pc.list_value_length(tokens)
        for name in extra:
            _check_beside(path, first, name, batch.column(name), lengths)
        short = _first(pc.less(lengths, 2))
        if short is not None:
            raise _bad_row(path, first + short, "`tokens` has fewer than 2 tokens", "drop the row")
        flat = pc.list_flatten(tokens)
        parents = pc.list_parent_indices(tokens)
        negative = _first(pc.less(flat, 0))
        if negative is not None:
            row = first + parents[negative].as_py()
            raise _bad_row(path, row, f"token id {flat[negative].as_py()}", "token ids are >= 0")
        outside = _first(pc.greater_equal(flat, limit))
        if outside is not None:
            row = first + parents[outside].as_py()
            where = (
                f"the vocabulary of {declared} the file declares"
                if declared
                else f"{MAX_IDS:,}, which would build an embedding of that many rows"
            )
            raise _bad_row(
                path,
                row,
                f"token id {flat[outside].as_py()} is outside {where}",
                "re-tokenize with the declared vocabulary",
            )
        top = max(top, pc.max(flat).as_py())
        longest = max(longest, pc.max(lengths).as_py())
    return (declared or top + 1), longest


def _check_beside(path: str, first: int, name: str, column, lengths) -> None:
    """A column beside the tokens (`loss_mask`: 0s and 1s; `documents`: example numbers ≥ 0
    that never go back) as long as its row's tokens."""
    fix = "write the file again with `rayacc data prepare --instruct`"
    _check_lists(path, first, column, name, fix)
    sizes = pc.list_value_length(column)
    if (other := _first(pc.not_equal(sizes, lengths))) is not None:
        why = f"`{name}` has {sizes[other].as_py()} entries for {lengths[other].as_py()} tokens"
        raise _bad_row(path, first + other, why, fix)
    values = pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.int64)
    parents = pc.list_parent_indices(column).to_numpy()
    if name == "documents":
        back = np.r_[False, (np.diff(values) < 0) & (np.diff(parents) == 0)]
        wrong, why = (values < 0) | back, "`documents` numbers go back or below 0"
    else:
        wrong = (values != 0) & (values != 1)
        why = f"`{name}` holds {values[wrong][:1].tolist()[0] if wrong.any() else 0}, not 0 or 1"
    if wrong.any():
        raise _bad_row(path, first + int(parents[int(np.argmax(wrong))]), why, fix)


def _list_of(kinds: tuple[str, ...], element) -> Any:
    def check(t: pa.DataType) -> bool:
        return any(getattr(pa.types, f"is_{k}")(t) for k in kinds) and element(t.value_type)

    return check


def _numeric(t: pa.DataType) -> bool:
    return pa.types.is_floating(t) or pa.types.is_integer(t)


COLUMNS: dict[str, dict[str, tuple[Any, str]]] = {
    "classification": {
        "features": (
            _list_of(("list", "large_list", "fixed_size_list"), _numeric),
            "list<float32> (a list of numbers per row; integers are widened)",
        ),
        "label": (pa.types.is_integer, "int64 (a class index per row)"),
    },
    "tokens": {
        "tokens": (
            _list_of(("list", "large_list"), pa.types.is_integer),
            "list<int64> (token ids; any integer width)",
        ),
        "loss_mask": (
            _list_of(("list", "large_list"), lambda t: pa.types.is_integer(t) or t == pa.bool_()),
            "list<uint8> (1 where the token counts as a target, 0 where not)",
        ),
        "documents": (
            _list_of(("list", "large_list"), pa.types.is_integer),
            "list<uint16> (each token's example in a packed row, from 0)",
        ),
    },
}
"""Every column rayacc reads, by format: what its type must be, and how to say it. Read values
are never cast from another type (numbers written as strings are a pipeline's bug to see)."""


def column_problems(schema: pa.Schema, fmt: str) -> str | None:
    """What is wrong with the types of `fmt`'s columns in `schema` (one sentence naming each
    column, its type and the one expected, and the fix), None when they are right."""
    wrong = [
        f"column `{name}` is {schema.field(name).type}, expected {expected}"
        for name, (fits, expected) in COLUMNS[fmt].items()
        if name in schema.names and not fits(schema.field(name).type)
    ]
    if not wrong:
        return None
    return "; ".join(wrong) + (
        ". Fix: write the columns with these types where the data is made (numbers stored as "
        "strings are not converted)"
    )


def _check_columns(
    source: str, ds: pq.ParquetDataset, fmt: str, columns: frozenset[str] = frozenset()
) -> None:
    """Every file's own column types (a folder's files may differ from the first one), and the
    `columns` the first one holds in every one (a part without `loss_mask` would fail the read
    of its rows)."""
    for fragment in ds.fragments:
        where = "" if fragment.path == source else f" (file {fragment.path})"
        if wrong := column_problems(fragment.physical_schema, fmt):
            raise DataError(f"data.source={source!r}{where}: {wrong}")
        if missing := sorted(columns - set(fragment.physical_schema.names)):
            raise DataError(
                f"data.source={source!r}{where}: no column {', '.join(missing)}, which the "
                "folder's first file holds: its files are of two preparations. Fix: prepare "
                "the folder again in one `rayacc data prepare`, or move the odd file out"
            )


def _declared_vocabulary(source: str, meta: dict[bytes, bytes]) -> tuple[str | None, int | None]:
    """The vocabulary (text) and its size that a token file's metadata declares, if any."""
    try:
        vocab = meta[VOCAB_KEY].decode("utf-8") if VOCAB_KEY in meta else None
        declared = len(vocab) if vocab else None
        if VOCAB_SIZE_KEY in meta:
            declared = int(meta[VOCAB_SIZE_KEY])
    except (UnicodeDecodeError, ValueError):
        raise DataError(
            f"data.source={source!r}: the schema's metadata {VOCAB_KEY.decode()!r} or "
            f"{VOCAB_SIZE_KEY.decode()!r} is malformed (not UTF-8 text, not a whole number). "
            "Fix: write the file again with `rayacc data prepare`, or drop those keys"
        ) from None
    if declared is not None and declared < 1:
        raise DataError(
            f"data.source={source!r}: the schema's metadata declares a vocabulary of "
            f"{declared} tokens. Fix: write the file again with `rayacc data prepare`"
        )
    return vocab, declared


def schema_metadata(source: str) -> dict[bytes, bytes]:
    """The key-value metadata of a Parquet source's schema (its first file's footer)."""
    return dict(_dataset(source).schema.metadata or {})


@dataclass(frozen=True)
class Source:
    """A Parquet source as the driver read it, once: its description, its row groups and its
    schema's metadata."""

    info: DatasetInfo
    groups: RowGroups
    metadata: dict[bytes, bytes]


def data_kind(source: str, cache_dir: str | None = None, seq_len: int = 128) -> DataKind | None:
    """What `data.source`'s rows are, from its schema alone (no pass over the rows: what
    `rayacc plan` reads); None for a remote source, which only the run reads."""
    if _is_uri(source):
        return None
    names = set(_dataset(_resolve(source, cache_dir, seq_len)).schema.names)
    return DataKind(packed="documents" in names, masked="loss_mask" in names)


def describe_dataset(source: str, cache_dir: str | None = None, seq_len: int = 128) -> DatasetInfo:
    """`read_source(...).info`."""
    return read_source(source, cache_dir, seq_len).info


def read_source(source: str, cache_dir: str | None = None, seq_len: int = 128) -> Source:
    """Resolves `data.source` (preparing a bundled dataset on first use) and checks it in one
    streamed pass: columns, nulls, non-finite features, ids; a bad row is named by file and
    row with the fix. The files are opened once for all of it."""
    source = _resolve(source, cache_dir, seq_len)
    ds = _dataset(source)
    info = _describe(source, ds)
    return Source(info, _row_groups(ds), dict(ds.schema.metadata or {}))


def _describe(source: str, ds: pq.ParquetDataset) -> DatasetInfo:
    odd = [f.path for f in ds.fragments if not f.path.endswith(".parquet")]
    if odd:
        raise DataError(
            f"data.source={source!r}: {odd[0]} does not end in .parquet (Ray Data skips such "
            "files, so the workers would read fewer rows than counted here). Fix: rename it to "
            "end in .parquet, or move it out of the folder"
        )
    schema = ds.schema
    names = set(schema.names)
    counts = [f.count_rows() for f in ds.fragments]
    num_rows = sum(counts)
    if num_rows == 0:
        raise DataError(f"data.source={source!r} holds no rows")
    fingerprint = _fingerprint(ds, counts)
    shape = {
        "num_row_groups": sum(f.metadata.num_row_groups for f in ds.fragments),
        "data_bytes": _data_bytes(ds, {"features", "label", "tokens", "loss_mask", "documents"}),
    }

    if {"features", "label"} <= names:
        _check_columns(source, ds, "classification")
        width, classes = _scan_classification(ds)
        return DatasetInfo(
            source,
            "classification",
            num_rows,
            num_features=width,
            num_classes=classes,
            fingerprint=fingerprint,
            **shape,
        )

    if "tokens" in names:
        extra = tuple(c for c in ("loss_mask", "documents") if c in names)
        _check_columns(source, ds, "tokens", frozenset(extra))
        vocab, declared = _declared_vocabulary(source, schema.metadata or {})
        vocab_size, longest = _scan_tokens(ds, declared, extra)
        return DatasetInfo(
            source,
            "tokens",
            num_rows,
            vocab_size=vocab_size,
            max_tokens=longest,
            vocab=vocab,
            fingerprint=fingerprint,
            loss_mask="loss_mask" in extra,
            documents="documents" in extra,
            **shape,
        )

    raise DataError(
        f"{source}: columns {sorted(names)} match no format. Fix: provide `features` "
        "(list<float32>) and `label` (int64) for classification, or `tokens` (list<int64>) for "
        "a language model"
    )
