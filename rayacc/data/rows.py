"""Rows on one process: `LocalRows` (a rank's rows as tensors, sliced into micro-batches), the
conversion of Parquet rows to them, and `read_rows` (rows by id, read with pyarrow from the row
groups that hold them). The worker's reader, the planner's calibration and `verify` share them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from rayacc.data.reads import parquet_file
from rayacc.data.sources import DatasetInfo, RowGroups
from rayacc.engine import collate_tokens

__all__ = [
    "LocalRows",
    "assemble",
    "columns_of",
    "group_of",
    "read_local_rows",
    "read_rows",
    "to_local_rows",
]


@dataclass
class LocalRows:
    """Rows held by one rank, in the order it consumes them; sliced into micro-batches."""

    format: str
    features: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    """Equal-length sequences as one [n, L] tensor."""
    token_lists: list[np.ndarray] | None = None
    """Sequences of varying length (collated and padded per micro-batch)."""

    def __len__(self) -> int:
        if self.format == "classification":
            return 0 if self.labels is None else len(self.labels)
        return len(self.tokens) if self.tokens is not None else len(self.token_lists or [])

    def take(self, index: np.ndarray) -> dict[str, torch.Tensor]:
        """A micro-batch of the rows at local positions `index`."""
        idx = torch.from_numpy(np.asarray(index, dtype=np.int64))
        if self.format == "classification":
            return {"features": self.features[idx], "label": self.labels[idx]}
        if self.tokens is not None:
            chunk = self.tokens[idx]
            return {"input": chunk[:, :-1], "target": chunk[:, 1:]}
        return collate_tokens([self.token_lists[i] for i in index])

    def take_split(self, index: np.ndarray, sizes: list[int]) -> list[dict[str, torch.Tensor]]:
        """Consecutive micro-batches of `sizes` rows from the rows at `index`: one gather for
        the whole window, the micro-batches are views of it (sequences of varying length are
        padded per micro-batch)."""
        if self.token_lists is not None:
            bounds = np.cumsum([0, *sizes])
            return [self.take(index[lo:hi]) for lo, hi in itertools.pairwise(bounds)]
        window = self.take(index)
        pieces = {k: torch.split(v, sizes) for k, v in window.items()}
        return [{k: v[i] for k, v in pieces.items()} for i in range(len(sizes))]


def columns_of(info: DatasetInfo) -> list[str]:
    return ["features", "label"] if info.format == "classification" else ["tokens"]


def to_local_rows(table: pa.Table, info: DatasetInfo) -> LocalRows:
    """Rows of a window (or the validation share) as tensors; token ids are stored as small as
    the file keeps them and widened to int64 here, for these rows only."""
    n = table.num_rows
    if info.format == "classification":
        flat = table["features"].combine_chunks().flatten().to_numpy(zero_copy_only=False)
        features = torch.from_numpy(np.array(flat, dtype=np.float32).reshape(n, info.num_features))
        labels = torch.from_numpy(table["label"].to_numpy().astype(np.int64))
        return LocalRows("classification", features=features, labels=labels)
    col = table["tokens"].combine_chunks()
    offsets = col.offsets.to_numpy()
    values = col.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = offsets - offsets[0]
    lengths = np.diff(offsets)
    if n and (lengths == lengths[0]).all():
        return LocalRows("tokens", tokens=torch.from_numpy(values.reshape(n, int(lengths[0]))))
    lists = [values[offsets[i] : offsets[i + 1]] for i in range(n)]
    return LocalRows("tokens", token_lists=lists)


def read_rows(info: DatasetInfo, groups: RowGroups, row_ids: np.ndarray) -> dict[str, Any]:
    """The rows `row_ids` of the source, in that order, as one batch, read on this process with
    pyarrow from the row groups that hold them only (for a probe of a few rows, as `verify`
    takes)."""
    return read_local_rows(info, groups, row_ids).take(np.arange(len(row_ids)))


def read_local_rows(info: DatasetInfo, groups: RowGroups, row_ids: np.ndarray) -> LocalRows:
    """The rows `row_ids` of the source (a file or a folder of files, local or a URI), in that
    order, read on this process from the row groups that hold them only."""
    row_ids = np.asarray(row_ids, dtype=np.int64)
    tables = {
        int(h): parquet_file(info.path, groups.files[groups.file[h]]).read_row_group(
            int(groups.index[h]), columns=columns_of(info)
        )
        for h in np.unique(group_of(groups, row_ids))
    }
    return to_local_rows(assemble(tables, groups, row_ids, info), info)


_EMPTY = {
    "tokens": pa.table({"tokens": pa.array([], pa.list_(pa.int64()))}),
    "classification": pa.table(
        {"features": pa.array([], pa.list_(pa.float32())), "label": pa.array([], pa.int64())}
    ),
}
"""No rows (a rank without validation rows), by format."""


def group_of(groups: RowGroups, rows: np.ndarray) -> np.ndarray:
    return np.searchsorted(groups.start, rows, side="right") - 1


def assemble(
    tables: dict[int, pa.Table], groups: RowGroups, rows: np.ndarray, info: DatasetInfo
) -> pa.Table:
    """The rows `rows` (ids) from the held row groups `tables`, in that order."""
    group = group_of(groups, rows)
    held = np.unique(group)
    if len(held) == 0:
        return _EMPTY[info.format]
    parts = [tables[int(h)] for h in held]
    offsets = np.concatenate([[0], np.cumsum([t.num_rows for t in parts])[:-1]])
    index = offsets[np.searchsorted(held, group)] + (rows - groups.start[group])
    return pa.concat_tables(parts, promote_options="permissive").take(pa.array(index))
