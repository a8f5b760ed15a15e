"""Ray Data → the rows one rank consumes, in the global-sample order (docs/design.md, "Data
order" and "Ingestion").

Every rank knows, from the data order alone, which positions of each epoch it consumes and so
which Parquet row groups those positions draw from, in the order it first needs them. It reads
exactly those row groups through a Ray Data pipeline of its own (`preserve_order`: a group's
place in the stream is known), whose read tasks run on any node with a free CPU and prefetch a
few blocks ahead; it keeps a group only until the last window that draws from it. With
`data.order: chunks` a group is read by the ranks whose shares it straddles, about once per
epoch over the cluster, and a rank holds a few groups at a time; with `rows` every rank reads
every group each epoch and holds one epoch's data.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from rayacc.data.order import DataOrder
from rayacc.data.reads import read_groups
from rayacc.data.rows import LocalRows, assemble, columns_of, group_of, to_local_rows
from rayacc.data.sources import DatasetInfo, RowGroups

__all__ = ["EpochReads", "RankReader", "warm_up"]

READ_TASK_ROWS = 16_384
"""Rows (whole row groups) one read task reads: fewer, larger tasks cost less scheduling, smaller
ones start the first step sooner and hold less in flight."""
PREFETCH_BLOCKS = 2
"""Read tasks' outputs a rank's iterator fetches ahead of the one it consumes."""


def warm_up() -> None:
    """Starts a worker process for this rank's first read task now (fire and forget): a rank
    calls it first thing, so the process starts while the model builds instead of when the
    first rows are needed (about 2.5 s on 2 cores)."""
    import ray

    from rayacc.data.reads import warm

    ray.remote(num_cpus=0.01)(warm).remote()


@dataclass
class EpochReads:
    """What one rank reads for one epoch: row groups in the order it first needs them, and the
    last window (index into the epoch's windows) that draws from each."""

    epoch: int
    lo: np.ndarray
    hi: np.ndarray
    """The rank's positions of each window: [lo_k, hi_k)."""
    groups: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    last_window: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


class RankReader:
    """One rank's rows: its validation share and, window after window, the rows of its share,
    read through Ray Data as described in this module's docstring, or with `in_process` (small
    data) read by this process itself, the same row groups in the same order."""

    def __init__(
        self,
        info: DatasetInfo,
        groups: RowGroups,
        order: DataOrder,
        source: str,
        in_process: bool = False,
    ):
        self.info, self.groups, self.order, self.source = info, groups, order, source
        self.in_process = in_process
        self.rows_read = 0
        """Rows of the row groups this reader has taken from the stream."""
        self._buffer: dict[int, pa.Table] = {}
        self._stream: Iterator[tuple[int, pa.Table]] | None = None
        self._cached: tuple[tuple[int, int], LocalRows] | None = None

    # ------------------------------------------------------------------ plan
    def group_of(self, rows: np.ndarray) -> np.ndarray:
        return group_of(self.groups, rows)

    def epoch_reads(self, epoch: int, lo: np.ndarray, hi: np.ndarray) -> EpochReads:
        reads = EpochReads(epoch, lo, hi)
        if len(lo) == 0:
            return reads
        if self.order.chunked:
            # a unit is a row group: no row ids needed to know what to read
            reads.groups, reads.last_window = self.order.units_of(epoch, lo, hi)
            return reads
        positions = np.concatenate([np.arange(a, b) for a, b in zip(lo, hi, strict=True)])
        owner = np.repeat(np.arange(len(lo)), hi - lo)
        group = self.group_of(self.order.row_ids(epoch, positions))
        reads.groups = np.unique(group)
        last = np.zeros(len(self.groups), dtype=np.int64)
        np.maximum.at(last, group, owner)
        reads.last_window = last[reads.groups]
        return reads

    def start(self, epochs: list[EpochReads], val_rows: np.ndarray) -> None:
        """Starts the stream of every row group this rank reads from here on: its validation
        rows' groups, then each epoch's."""
        self.val_rows = val_rows
        self.val_groups = np.unique(self.group_of(val_rows))
        self.epochs = {e.epoch: e for e in epochs}
        order = np.concatenate([self.val_groups, *(e.groups for e in epochs)]).astype(np.int64)
        self._stream = self._open(order)

    def restart(self, epochs: list[EpochReads]) -> None:
        """Re-plans the stream from here on, where the windows are laid out anew (the next
        phase of `batch.schedule`): the groups held that the first epoch still reads are kept
        and not read again, the others dropped."""
        self.epochs, self._cached = {e.epoch: e for e in epochs}, None
        first = epochs[0].groups if epochs else np.zeros(0, dtype=np.int64)
        for group in set(self._buffer) - set(first.tolist()):
            del self._buffer[group]
        rest = [e.groups for e in epochs[1:]]
        order = np.concatenate([first[~np.isin(first, list(self._buffer))], *rest])
        self._stream = self._open(order.astype(np.int64))

    def _open(self, order: np.ndarray) -> Iterator[tuple[int, pa.Table]]:
        """(group, table) for each group of `order`, in that order, read by Ray Data tasks (or
        by this process)."""
        if len(order) == 0:
            return iter(())
        g = self.groups
        sizes = g.size[order]
        task = np.cumsum(sizes) // READ_TASK_ROWS
        cuts = np.flatnonzero(np.diff(task)) + 1
        blocks = [
            pa.table({"file": [g.files[f] for f in g.file[part]], "group": g.index[part]})
            for part in np.split(order, cuts)
        ]
        kwargs = {"source": self.source, "columns": columns_of(self.info)}
        if self.in_process:
            # read when needed, one task's worth at a time: what a read task would do
            return _split_groups((read_groups(b, **kwargs) for b in blocks), order, sizes)
        import ray.data
        from ray.data import DataContext

        ctx = DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ctx.enable_progress_bars = False
        ds = ray.data.from_arrow(blocks).map_batches(
            read_groups, batch_size=None, batch_format="pyarrow", fn_kwargs=kwargs
        )
        batches = ds.iter_batches(
            batch_size=None, batch_format="pyarrow", prefetch_batches=PREFETCH_BLOCKS
        )
        return _split_groups(iter(batches), order, sizes)

    def _pull(self, needed: np.ndarray) -> None:
        """Takes groups from the stream until every group of `needed` is held."""
        missing = set(needed.tolist()) - self._buffer.keys()
        while missing:
            group, table = next(self._stream)
            self._buffer[group] = table
            self.rows_read += table.num_rows
            missing.discard(group)

    def _gather(self, rows: np.ndarray) -> LocalRows:
        self._pull(np.unique(self.group_of(rows)))
        return to_local_rows(assemble(self._buffer, self.groups, rows, self.info), self.info)

    # ------------------------------------------------------------------ consume
    def validation(self) -> LocalRows:
        """This rank's validation rows (read first; held for the run)."""
        rows = self._gather(self.val_rows)
        for group in self.val_groups:
            self._buffer.pop(int(group), None)
        return rows

    def window(self, epoch: int, k: int) -> LocalRows:
        """The rows of this rank's share of window `k` of `epoch`, in the order it consumes
        them; the groups no later window of the epoch draws from are dropped."""
        if self._cached and self._cached[0] == (epoch, k):
            return self._cached[1]
        reads = self.epochs[epoch]
        positions = np.arange(reads.lo[k], reads.hi[k])
        rows = self._gather(self.order.row_ids(epoch, positions))
        for group in reads.groups[reads.last_window == k]:
            self._buffer.pop(int(group), None)
        self._cached = ((epoch, k), rows)
        return rows


def _split_groups(
    batches: Iterator[pa.Table], order: np.ndarray, sizes: np.ndarray
) -> Iterator[tuple[int, pa.Table]]:
    """The stream of read-task outputs cut back into its row groups (Ray Data may merge or
    split blocks; it keeps their order)."""
    carry: list[pa.Table] = []
    held = 0
    for group, size in zip(order.tolist(), sizes.tolist(), strict=True):
        while held < size:
            batch = next(batches, None)
            if batch is None:
                raise RuntimeError(
                    f"the data stream ended before row group {group}; the files changed "
                    "during the run"
                )
            carry.append(batch)
            held += batch.num_rows
        table = pa.concat_tables(carry, promote_options="permissive")
        yield group, table.slice(0, size).combine_chunks()
        rest = table.slice(size)
        carry, held = ([rest] if rest.num_rows else []), rest.num_rows
