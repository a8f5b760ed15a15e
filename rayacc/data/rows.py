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
from rayacc.engine import IGNORE_INDEX, collate_tokens

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
    masks: torch.Tensor | None = None
    """Instruction data: 1 where a token counts as a target, shaped as `tokens`."""
    mask_lists: list[np.ndarray] | None = None
    """The same, shaped as `token_lists`."""
    documents: torch.Tensor | None = None
    """Packed rows: each token's example (numbered in its row), shaped as `tokens`."""
    document_lists: list[np.ndarray] | None = None
    """The same, shaped as `token_lists`."""

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
            batch = {"input": chunk[:, :-1], "target": chunk[:, 1:]}
            if self.masks is not None:
                batch["target"] = _masked(batch["target"], self.masks[idx][:, 1:])
            if self.documents is not None:
                batch["documents"] = self.documents[idx][:, :-1]
            return batch
        batch = collate_tokens([self.token_lists[i] for i in index])
        if self.mask_lists is not None:
            masks = collate_tokens([self.mask_lists[i] for i in index], pad_id=0)["target"]
            batch["target"] = _masked(batch["target"], masks)
        if self.document_lists is not None:
            # padding: an example of its own (its targets are ignored)
            docs = [self.document_lists[i] for i in index]
            batch["documents"] = collate_tokens(docs, pad_id=-1)["input"]
        return batch

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


def _masked(target: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Targets the mask does not count become IGNORE_INDEX: they carry no loss and no count,
    so the one normalisation rule (the global count of loss items) covers masks as it covers
    padding."""
    return torch.where(counts == 1, target, IGNORE_INDEX)


def columns_of(info: DatasetInfo) -> list[str]:
    if info.format == "classification":
        return ["features", "label"]
    beside = [
        c for c, held in (("loss_mask", info.loss_mask), ("documents", info.documents)) if held
    ]
    return ["tokens", *beside]


def to_local_rows(table: pa.Table, info: DatasetInfo) -> LocalRows:
    """Rows of a window (or the validation share) as tensors; token ids are stored as small as
    the file keeps them and widened to int64 here, for these rows only."""
    n = table.num_rows
    if info.format == "classification":
        flat = table["features"].combine_chunks().flatten().to_numpy(zero_copy_only=False)
        features = torch.from_numpy(np.array(flat, dtype=np.float32).reshape(n, info.num_features))
        labels = torch.from_numpy(table["label"].to_numpy().astype(np.int64))
        return LocalRows("classification", features=features, labels=labels)
    offsets, values = _flat(table["tokens"])
    beside = {c: _flat(table[c])[1] for c in ("loss_mask", "documents") if c in table.column_names}
    lengths = np.diff(offsets)
    if n and (lengths == lengths[0]).all():
        shape = (n, int(lengths[0]))
        held = {c: torch.from_numpy(v.reshape(shape)) for c, v in beside.items()}
        return LocalRows(
            "tokens",
            tokens=torch.from_numpy(values.reshape(shape)),
            masks=held.get("loss_mask"),
            documents=held.get("documents"),
        )

    def rows_of(flat: np.ndarray) -> list[np.ndarray]:
        return [flat[offsets[i] : offsets[i + 1]] for i in range(n)]

    held = {c: rows_of(v) for c, v in beside.items()}
    return LocalRows(
        "tokens",
        token_lists=rows_of(values),
        mask_lists=held.get("loss_mask"),
        document_lists=held.get("documents"),
    )


def _flat(column) -> tuple[np.ndarray, np.ndarray]:
    """(offsets from 0, values as int64) of a list column."""
    col = column.combine_chunks()
    offsets = col.offsets.to_numpy()
    values = col.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    return offsets - offsets[0], values


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
    "tokens": pa.array([], pa.list_(pa.int64())),
    "loss_mask": pa.array([], pa.list_(pa.uint8())),
    "documents": pa.array([], pa.list_(pa.uint16())),
    "features": pa.array([], pa.list_(pa.float32())),
    "label": pa.array([], pa.int64()),
}
"""No rows (a rank without validation rows), by column."""


def group_of(groups: RowGroups, rows: np.ndarray) -> np.ndarray:
    return np.searchsorted(groups.start, rows, side="right") - 1


def assemble(
    tables: dict[int, pa.Table], groups: RowGroups, rows: np.ndarray, info: DatasetInfo
) -> pa.Table:
    """The rows `rows` (ids) from the held row groups `tables`, in that order."""
    group = group_of(groups, rows)
    held = np.unique(group)
    if len(held) == 0:
        return pa.table({c: _EMPTY[c] for c in columns_of(info)})
    parts = [tables[int(h)] for h in held]
    offsets = np.concatenate([[0], np.cumsum([t.num_rows for t in parts])[:-1]])
    index = offsets[np.searchsorted(held, group)] + (rows - groups.start[group])
    return pa.concat_tables(parts, promote_options="permissive").take(pa.array(index))
