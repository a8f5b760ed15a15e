"""Hugging Face `datasets` folders (`Dataset.save_to_disk`): Arrow files and a `state.json`
listing them; a `DatasetDict`'s folder holds one such folder per split (`dataset_dict.json`).
Read with pyarrow alone (the `datasets` package is not needed), every file named checked to be
inside the folder. `data.source` takes one whose rows are token ids (`tokens` or `input_ids`):
it becomes Parquet once, in rayacc's cache; `rayacc data prepare` tokenizes one's `text`."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rayacc.data.common import DataError

__all__ = ["TOKEN_COLUMNS", "as_parquet", "read_saved", "saved_dataset"]

TOKEN_COLUMNS = ("tokens", "input_ids")
"""A saved dataset's token column: rayacc's name, or `transformers` tokenizers'."""


def saved_dataset(folder: Path) -> Path | None:
    """The dataset folder `folder` is (a DatasetDict's: its `train` split), or None when it is
    not a `save_to_disk` folder."""
    if (folder / "state.json").is_file():
        return folder
    listing = folder / "dataset_dict.json"
    if not listing.is_file():
        return None
    splits = _json(listing).get("splits")
    if not isinstance(splits, list):
        raise DataError(f"{listing}: no list of splits. Fix: give a save_to_disk folder")
    if "train" not in splits:
        raise DataError(
            f"{folder}: a DatasetDict without a `train` split (splits: "
            f"{', '.join(map(str, splits))}). Fix: give the folder of the split to train on, "
            f"e.g. {folder}/{splits[0]}"
        )
    return saved_dataset(folder / "train") or _not_saved(folder / "train")


def _not_saved(folder: Path):
    raise DataError(f"{folder}: no state.json. Fix: give a folder save_to_disk wrote")


def _json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise DataError(f"{path}: not JSON ({type(exc).__name__}). Fix: {_FIX}") from None
    if not isinstance(doc, dict):
        raise DataError(f"{path}: not a JSON object. Fix: {_FIX}")
    return doc


_FIX = "give a folder datasets' save_to_disk wrote, unchanged"


def _files(folder: Path) -> list[Path]:
    listed = _json(folder / "state.json").get("_data_files")
    if not isinstance(listed, list) or not listed:
        raise DataError(f"{folder}/state.json lists no data files. Fix: {_FIX}")
    files = []
    for entry in listed:
        name = entry.get("filename") if isinstance(entry, dict) else None
        # a name is a file of this folder: never a path elsewhere
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise DataError(f"{folder}/state.json names {name!r}, not a file of it. Fix: {_FIX}")
        if not (folder / name).is_file():
            raise DataError(f"{folder}/{name}: listed in state.json, missing. Fix: {_FIX}")
        files.append(folder / name)
    return files


def read_saved(folder: Path) -> pa.Table:
    """The dataset's rows (its Arrow stream files, in order)."""
    tables = []
    for path in _files(folder):
        try:
            with pa.memory_map(str(path)) as source:
                tables.append(pa.ipc.open_stream(source).read_all())
        except pa.ArrowInvalid as exc:
            raise DataError(f"{path}: not an Arrow stream ({exc}). Fix: {_FIX}") from None
    try:
        return pa.concat_tables(tables)
    except pa.ArrowInvalid as exc:
        raise DataError(f"{folder}: its files' columns differ ({exc}). Fix: {_FIX}") from None


def as_parquet(folder: Path, cache: Path) -> Path:
    """The token rows of the saved dataset `folder` as Parquet under `cache` (written once per
    version of the dataset: its files' names, sizes and times)."""
    files = _files(folder)
    stamp = hashlib.sha256(
        "\n".join(
            f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files
        ).encode()
    ).hexdigest()[:16]
    out = cache / "saved_datasets" / stamp / "tokens.parquet"
    if out.is_file():
        return out
    table = read_saved(folder)
    column = next((c for c in TOKEN_COLUMNS if c in table.column_names), None)
    if column is None:
        raise DataError(
            f"{folder}: a saved dataset without a token column ({' or '.join(TOKEN_COLUMNS)}; "
            f"it has {', '.join(table.column_names)}). Fix: tokenize it first (rayacc data "
            f"prepare {folder} --out DIR --tokenizer tokenizer.json reads its `text`)"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    pq.write_table(pa.table({"tokens": table[column]}), partial, row_group_size=1024)
    partial.replace(out)
    return out
