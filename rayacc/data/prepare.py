"""`rayacc data prepare FILE... --out DIR`: the user's text or JSONL → token Parquet that the
ranks' reader serves well (docs/design.md, "Data order").

Text files are documents; JSONL files hold one document per line in a field (`text` unless told
otherwise). Documents are tokenized (byte-level: ids 0..255 and 256 ending each document, or a
`tokenizer.json` through the `tokenizers` package), joined into one stream and cut into rows of
`seq_len + 1` tokens (each token a target once). Rows go to Parquet parts in row groups of
`rows_per_group` rows, token ids stored as uint16 (vocabularies up to 65,536) or int32. Everything
streams: memory holds one part's rows at most. Written in a folder beside the target and renamed
into place at the end, so a failed run leaves nothing half-written.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rayacc import env
from rayacc.data.common import ORIGIN_KEY, TOKENIZER_KEY, VOCAB_SIZE_KEY, DataError
from rayacc.data.reads import filesystem_and_path

__all__ = ["PrepareResult", "prepare_corpus"]

BYTE_VOCAB = 257
"""Byte-level vocabulary: the 256 byte values and one end-of-document id (256)."""
_READ_BYTES = 1 << 22


@dataclass(frozen=True)
class PrepareResult:
    out: str
    rows: int
    files: int
    tokens: int
    vocab_size: int
    dtype: str


def _filesystem(path: str):
    """(filesystem, path on it); a local path made absolute."""
    return filesystem_and_path(path if "://" in path else str(Path(path).expanduser().resolve()))


def _input_files(inputs: list[str]) -> list[tuple[object, str, str]]:
    """(filesystem, path on it, name to show) of every input file; a folder gives its files."""
    from pyarrow import fs

    files = []
    for item in inputs:
        filesystem, path = _filesystem(item)
        info = filesystem.get_file_info(path)
        if info.type == fs.FileType.NotFound:
            raise DataError(f"{item}: no such file or folder. Fix: give text or JSONL files")
        if info.type == fs.FileType.Directory and "://" not in item:
            from rayacc.data.saved_dataset import saved_dataset

            # a Hugging Face `datasets` folder: its rows' text, not its files as text
            if (saved := saved_dataset(Path(path))) is not None:
                files.append((SAVED, str(saved), item))
                continue
        if info.type == fs.FileType.Directory:
            found = filesystem.get_file_info(fs.FileSelector(path, recursive=True))
            inner = sorted(i.path for i in found if i.type == fs.FileType.File)
            if not inner:
                raise DataError(
                    f"{item}: the folder holds no files. Fix: give the folder of your text or "
                    "JSONL files, or the files themselves"
                )
            files += [(filesystem, p, p) for p in inner]
        else:
            if info.size == 0:
                raise DataError(
                    f"{item} is empty. Fix: give text or JSONL files that hold the corpus"
                )
            files.append((filesystem, path, item))
    return files


SAVED = "saved dataset"
"""The input kind of a `datasets.save_to_disk` folder (in place of a filesystem)."""


def _saved_texts(path: str, shown: str, text_field: str) -> Iterator[tuple[str, bool]]:
    from rayacc.data.saved_dataset import read_saved

    table = read_saved(Path(path))
    if text_field not in table.column_names:
        raise DataError(
            f"{shown}: a saved dataset without a {text_field!r} column (it has "
            f"{', '.join(table.column_names)}). Fix: --text-field COLUMN; a dataset of token ids "
            "(tokens or input_ids) is data.source as it is"
        )
    for i, text in enumerate(table[text_field].to_pylist()):
        if not isinstance(text, str):
            raise DataError(
                f"{shown}: row {i}'s {text_field!r} is {type(text).__name__}, not text. Fix: "
                "--text-field naming the column of text"
            )
        yield text, True


def _texts(filesystem, path: str, shown: str, text_field: str) -> Iterator[tuple[str, bool]]:
    """(piece of text, whether a document ends with it) for one file: a text file is one
    document (in pieces), a JSONL file one per line, a saved dataset one per row; DataError
    naming the file (and line) with the fix."""
    if filesystem == SAVED:
        yield from _saved_texts(path, shown, text_field)
        return
    jsonl = path.endswith((".jsonl", ".json", ".ndjson"))
    decoder = codecs.getincrementaldecoder("utf-8")()
    done = 0
    carry = ""
    line_no = 0
    with filesystem.open_input_stream(path) as stream:
        while True:
            raw = stream.read(_READ_BYTES)
            try:
                text = decoder.decode(raw, final=not raw)
            except UnicodeDecodeError as exc:
                raise DataError(
                    f"{shown}: not UTF-8 text at byte {done + exc.start}. Fix: convert the file "
                    "to UTF-8, or leave it out"
                ) from None
            done += len(raw)
            if not jsonl:
                # pieces end at a line break, so that no word is cut between two encodings
                text = carry + text
                cut = text.rfind("\n") + 1 if raw else len(text)
                carry = text[cut:]
                if cut or not raw:
                    yield text[:cut], not raw
            else:
                lines = (carry + text).split("\n")
                carry = lines.pop() if raw else ""
                for line in [*lines, carry] if not raw else lines:
                    line_no += 1
                    if line.strip():
                        yield _json_text(line, shown, line_no, text_field), True
            if not raw:
                return


def _json_text(line: str, shown: str, line_no: int, text_field: str) -> str:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, RecursionError) as exc:
        why = getattr(exc, "msg", "nested deeper than the parser follows")
        raise DataError(
            f"{shown}, line {line_no}: not JSON ({why}). Fix: one JSON object per line"
        ) from None
    if (
        isinstance(record, dict)
        and text_field in record
        and not isinstance(record[text_field], str)
    ):
        raise DataError(
            f"{shown}, line {line_no}: the text field {text_field!r} holds a "
            f"{type(record[text_field]).__name__}, not text. Fix: --text-field NAME of a field "
            "that holds each record's text"
        )
    if not isinstance(record, dict) or text_field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(
            f"{shown}, line {line_no}: no text field {text_field!r} (found {keys}). "
            "Fix: --text-field NAME"
        )
    return record[text_field]


@dataclass(frozen=True)
class _Tokenizer:
    encode: Callable[[str], np.ndarray]
    """A piece of a document → ids."""
    eod: int | None
    """The id that ends a document, if any."""
    vocab_size: int
    described: str
    recorded: bytes
    """What the files keep of it (TOKENIZER_KEY): decoding needs it (`rayacc sample`)."""


def _tokenizer(path: str | None) -> _Tokenizer:
    if path is None:
        return _Tokenizer(
            lambda text: np.frombuffer(text.encode("utf-8"), dtype=np.uint8),
            BYTE_VOCAB - 1,
            BYTE_VOCAB,
            "byte-level",
            b"bytes",
        )
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise DataError(
            "--tokenizer needs the `tokenizers` package: pip install tokenizers"
        ) from None
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:
        raise DataError(
            f"{path}: not a tokenizer.json the `tokenizers` package reads ({exc}). Fix: give "
            "the tokenizer.json saved with the model's tokenizer"
        ) from None

    def encode(text: str) -> np.ndarray:
        return np.asarray(tok.encode(text, add_special_tokens=False).ids)

    vocab = tok.get_vocab_size()
    return _Tokenizer(
        encode,
        None,
        vocab,
        f"tokenizer {Path(path).name} ({vocab} ids)",
        tok.to_str().encode("utf-8"),
    )


class _PartWriter:
    """Rows of `width` tokens into part-NNNNN.parquet files of `rows_per_file` rows each, in
    row groups of `rows_per_group`."""

    def __init__(
        self,
        folder: Path,
        width: int,
        dtype,
        rows_per_group: int,
        rows_per_file: int,
        metadata: dict[bytes, bytes],
    ):
        self.folder, self.width, self.dtype = folder, width, dtype
        self.rows_per_group, self.rows_per_file = rows_per_group, rows_per_file
        self.schema = pa.schema(
            [("tokens", pa.list_(pa.from_numpy_dtype(dtype)))], metadata=metadata
        )
        self.pending: list[np.ndarray] = []
        self.pending_rows = 0
        self.rows = 0
        self.files = 0

    def add(self, rows: np.ndarray) -> None:
        self.pending.append(rows)
        self.pending_rows += len(rows)
        while self.pending_rows >= self.rows_per_file:
            self._flush(self.rows_per_file)

    def close(self) -> None:
        if self.pending_rows:
            self._flush(self.pending_rows)

    def _flush(self, n: int) -> None:
        block = np.concatenate(self.pending)
        part, rest = block[:n], block[n:]
        self.pending, self.pending_rows = ([rest] if len(rest) else []), len(rest)
        values = pa.array(part.reshape(-1))
        offsets = pa.array(np.arange(0, (n + 1) * self.width, self.width, dtype=np.int32))
        table = pa.Table.from_arrays(
            [pa.ListArray.from_arrays(offsets, values)], schema=self.schema
        )
        pq.write_table(
            table,
            self.folder / f"part-{self.files:05d}.parquet",
            row_group_size=self.rows_per_group,
        )
        self.files += 1
        self.rows += n


@dataclass(frozen=True)
class _Layout:
    seq_len: int
    rows_per_group: int
    rows_per_file: int
    text_field: str


def prepare_corpus(
    inputs: list[str],
    out: str,
    *,
    seq_len: int = 128,
    tokenizer: str | None = None,
    text_field: str = "text",
    rows_per_group: int = 64,
    rows_per_file: int = 1 << 20,
    shuffle: bool = False,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> PrepareResult:
    """Tokenizes `inputs` into token Parquet under `out` (a new folder); see the module doc."""
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    target = Path(out).expanduser().resolve()
    if target.is_file() or (target.is_dir() and any(target.iterdir())):
        raise DataError(f"--out {out} exists and is not empty. Fix: give a new folder")
    files = _input_files(inputs)
    layout = _Layout(seq_len, rows_per_group, rows_per_file, text_field)
    staging = target.parent / f".{target.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        result = _write_rows(files, _tokenizer(tokenizer), staging, layout, say)
        if shuffle:
            say(f"shuffling {result.rows:,} rows with Ray Data (seed {seed})")
            shuffled = target.parent / f".{target.name}.shuffled"
            _shuffle(staging, shuffled, seed, rows_per_group, rows_per_file)
            shutil.rmtree(staging)
            staging = shuffled
        if target.exists():
            target.rmdir()
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    say(
        f"{out}: {result.rows:,} rows of {seq_len + 1} tokens ({result.dtype}) in "
        f"{result.files} file(s), row groups of {rows_per_group} rows"
    )
    return dataclasses.replace(result, out=str(target))


def _write_rows(files, tokenizer: _Tokenizer, staging: Path, layout: _Layout, say) -> PrepareResult:
    encode, eod, vocab = tokenizer.encode, tokenizer.eod, tokenizer.vocab_size
    width = layout.seq_len + 1
    dtype = np.uint16 if vocab <= 1 << 16 else np.int32
    metadata = {
        VOCAB_SIZE_KEY: str(vocab).encode(),
        ORIGIN_KEY: tokenizer.described.encode(),
        TOKENIZER_KEY: tokenizer.recorded,
    }
    writer = _PartWriter(
        staging, width, dtype, layout.rows_per_group, layout.rows_per_file, metadata
    )
    stream = np.zeros(0, dtype=dtype)
    tokens = 0
    last_said = time.monotonic()
    for i, (filesystem, path, shown) in enumerate(files):
        for text, ends in _texts(filesystem, path, shown, layout.text_field):
            piece = encode(text).astype(dtype)
            if ends and eod is not None:
                piece = np.append(piece, np.asarray(eod, dtype=dtype))
            tokens += len(piece)
            stream = np.concatenate([stream, piece])
            n = (len(stream) - 1) // layout.seq_len
            if n:
                # rows overlap by one token: each token is a target once
                index = np.arange(n)[:, None] * layout.seq_len + np.arange(width)
                writer.add(stream[index])
                stream = stream[n * layout.seq_len :]
        if time.monotonic() - last_said > 2 or i == len(files) - 1:
            rows = writer.rows + writer.pending_rows
            say(f"  {i + 1}/{len(files)} files, {tokens:,} tokens, {rows:,} rows")
            last_said = time.monotonic()
    writer.close()
    if writer.rows == 0:
        raise DataError(
            f"the inputs ({', '.join(name for _, _, name in files[:3])}"
            f"{', …' if len(files) > 3 else ''}) hold {tokens} tokens, fewer than one row of "
            f"{width}. Fix: lower --seq-len or give more text"
        )
    return PrepareResult("", writer.rows, writer.files, tokens, vocab, np.dtype(dtype).name)


def _shuffle(
    source: Path, target: Path, seed: int, rows_per_group: int, rows_per_file: int
) -> None:
    """A global shuffle of the rows by Ray Data (spilling to disk beyond memory), written back
    in the same layout."""
    import ray
    import ray.data

    if not ray.is_initialized():
        env.plain_ray_lines()
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    schema = pq.read_schema(sorted(source.glob("*.parquet"))[0])
    ds = ray.data.read_parquet(str(source)).random_shuffle(seed=seed)
    target.mkdir(parents=True)
    writer, part, rows = None, 0, 0
    try:
        for batch in ds.iter_batches(batch_size=rows_per_group * 64, batch_format="pyarrow"):
            table = batch.cast(schema)
            while table.num_rows:
                if writer is None:
                    writer = pq.ParquetWriter(target / f"part-{part:05d}.parquet", schema)
                    part, rows = part + 1, 0
                take = min(table.num_rows, rows_per_file - rows)
                writer.write_table(table.slice(0, take), row_group_size=rows_per_group)
                rows, table = rows + take, table.slice(take)
                if rows == rows_per_file:
                    writer.close()
                    writer = None
    finally:
        if writer is not None:
            writer.close()
