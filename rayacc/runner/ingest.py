"""Ray Data → the rows one rank consumes, in the global-sample order.

Ray Data's `streaming_split` hands rows to ranks dynamically, so which rank sees which row (and in
which order) is not reproducible. Here every rank streams the unsplit dataset (`train_dataset`)
once when it starts, in row order (`preserve_order=True`, so a row's position in the stream is
its row id), and keeps the rows that the data order assigns to it in the epochs it will run.
Cost: each rank streams the whole dataset once per start (from the object store when
materialized) and holds its rows for all remaining epochs: N/W rows for one epoch, up to N with
several shuffled epochs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
import torch

from rayacc.data.sources import DatasetInfo
from rayacc.engine import collate_tokens

__all__ = ["LocalRows", "fetch_rows", "read_rows", "stage_file", "train_dataset"]

_STREAM_BATCH = 8192


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


def _to_local(table: pa.Table, info: DatasetInfo) -> LocalRows:
    n = table.num_rows
    if info.format == "classification":
        flat = table["features"].combine_chunks().flatten().to_numpy(zero_copy_only=False)
        features = torch.from_numpy(np.array(flat, dtype=np.float32).reshape(n, info.num_features))
        labels = torch.from_numpy(table["label"].to_numpy().astype(np.int64))
        return LocalRows("classification", features=features, labels=labels)
    col = table["tokens"].combine_chunks()
    offsets = col.offsets.to_numpy()
    values = col.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
    lengths = np.diff(offsets)
    if n and (lengths == lengths[0]).all():
        return LocalRows("tokens", tokens=torch.from_numpy(values.reshape(n, int(lengths[0]))))
    lists = [values[offsets[i] : offsets[i + 1]] for i in range(n)]
    return LocalRows("tokens", token_lists=lists)


def train_dataset(
    info: DatasetInfo, materialize: bool, shared_path: str | None = None
) -> ray.data.Dataset:
    """The Ray Dataset the ranks stream their rows from. Materialized: the Parquet read once
    here with pyarrow into Ray's object store (for data that fits this process's memory; it
    starts no Ray Data execution, which costs seconds on a small cluster), so no other node
    reads a file. Otherwise read by Ray Data in every rank, from `shared_path` when given: a
    copy of a file only this node has (a bundled dataset prepared in its cache) where every
    node reaches it."""
    if materialize:
        return ray.data.from_arrow(_read_table(info))
    return ray.data.read_parquet(shared_path or info.path)


def stage_file(path: str, storage: str) -> str:
    """A copy of the local Parquet file `path` under `storage` (a path or URI every node
    reaches: the run's storage path), made once; its path there."""
    from pyarrow import fs

    from rayacc.runner.runs import storage_filesystem

    name = Path(path).name
    filesystem, root = storage_filesystem(storage)
    target = f"{root}/_data/{name}"
    info = filesystem.get_file_info(target)
    if info.type != fs.FileType.File or info.size != Path(path).stat().st_size:
        filesystem.create_dir(f"{root}/_data", recursive=True)
        fs.copy_files(path, target, fs.LocalFileSystem(), filesystem)
    return target if "://" not in storage else f"{storage.rstrip('/')}/_data/{name}"


def _read_table(info: DatasetInfo) -> pa.Table:
    # the fragments in the order describe_dataset counted them: a row's position is its id
    return pq.ParquetDataset(info.path).read()


def read_rows(info: DatasetInfo, row_ids: np.ndarray) -> dict[str, torch.Tensor]:
    """The rows `row_ids` of the source, in that order, as one batch, read on this process
    with pyarrow (for a probe of a few rows, as `verify` takes)."""
    table = _read_table(info).take(pa.array(row_ids))
    return _to_local(table, info).take(np.arange(len(row_ids)))


def fetch_rows(dataset, info: DatasetInfo, row_ids: np.ndarray) -> LocalRows:
    """One pass over `dataset` (anything with Ray Data's `iter_batches`, in row order);
    returns the rows `row_ids` (sorted, unique) in that order."""
    row_ids = np.asarray(row_ids, dtype=np.int64)
    if len(row_ids) > 1 and not (np.diff(row_ids) > 0).all():
        raise ValueError("row_ids must be sorted and unique")
    wanted = np.zeros(info.num_rows, dtype=bool)
    wanted[row_ids] = True
    pieces: list[pa.Table] = []
    offset = 0
    for batch in dataset.iter_batches(
        batch_size=_STREAM_BATCH, batch_format="pyarrow", prefetch_batches=2
    ):
        n = batch.num_rows
        if offset + n > info.num_rows:
            raise RuntimeError(
                f"{info.path} now holds more than the {info.num_rows} rows counted at start; "
                "the data changed during the run"
            )
        mask = wanted[offset : offset + n]
        if mask.any():
            # the stream is in row-id order, so the kept rows stay sorted
            pieces.append(batch.filter(pa.array(mask)))
        offset += n
    if offset != info.num_rows:
        raise RuntimeError(f"{info.path}: read {offset} rows, expected {info.num_rows}")
    table = pa.concat_tables(pieces) if pieces else _empty(info)
    if table.num_rows != len(row_ids):
        raise RuntimeError(f"kept {table.num_rows} rows of {info.path}, expected {len(row_ids)}")
    return _to_local(table, info)


def _empty(info: DatasetInfo) -> pa.Table:
    if info.format == "classification":
        return pa.table(
            {"features": pa.array([], pa.list_(pa.float32())), "label": pa.array([], pa.int64())}
        )
    return pa.table({"tokens": pa.array([], pa.list_(pa.int64()))})
