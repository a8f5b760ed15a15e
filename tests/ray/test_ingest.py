"""The ranks' reader on a real local Ray: Ray Data reads the row groups each rank's share draws
from, in order; the rows delivered are the data order's sample ids, each once per epoch, across
a restart at another size; in the chunk order each row is read about once per epoch."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayacc.data.order import DataOrder, EpochLayout
from rayacc.data.prepare import prepare_corpus
from rayacc.data.sources import describe_dataset, row_groups
from rayacc.worker.ingest import RankReader
from tests.support.data.corpus import corpus, quiet, rows_of

ROWS = 600


@pytest.fixture
def id_tokens(tmp_path):
    """Two Parquet files of token rows whose first token is the row id; row groups of 8 rows;
    tokens stored as uint16."""
    folder = tmp_path / "ids"
    folder.mkdir()
    for part, (lo, hi) in enumerate([(0, 264), (264, ROWS)]):
        rows = [[i, 1 + i % 7, 2 + i % 5] for i in range(lo, hi)]
        table = pa.table({"tokens": pa.array(rows, pa.list_(pa.uint16()))})
        pq.write_table(table, folder / f"part-{part}.parquet", row_group_size=8)
    return str(folder)


def read_epoch_part(info, groups, order, epoch, layouts, in_process=False):
    """Runs readers for (layout, offset, steps) in turn, as groups of ranks after restarts;
    returns (ids per window and rank, expected ids, rows read per rank, the last group's
    validation ids)."""
    got, want, reads = [], [], []
    for layout, offset, steps in layouts:
        val = []
        for rank in range(layout.num_workers):
            reader = RankReader(info, groups, order, info.path, in_process=in_process)
            lo, hi = layout.rank_intervals(rank, steps)
            lo, hi = lo + offset, hi + offset
            val_rows = order.val_rows(rank, layout.num_workers)
            reader.start([reader.epoch_reads(epoch, lo, hi)], val_rows)
            val.append(reader.validation().tokens[:, 0].numpy())
            after_val = reader.rows_read
            for k in range(len(lo)):
                got.append(reader.window(epoch, k).tokens[:, 0].numpy())
                want.append(order.row_ids(epoch, np.arange(lo[k], hi[k])))
            reads.append((reader.rows_read - after_val, int((hi - lo).sum())))
    return got, want, reads, np.concatenate(val)


@pytest.mark.parametrize("in_process", [False, True], ids=["ray-data", "in-process"])
def test_chunk_reader_delivers_the_order_once_across_a_resize_reading_each_row_once(
    ray_local, id_tokens, in_process
):
    info = describe_dataset(id_tokens)
    groups = row_groups(info.path)
    assert len(groups) == 33 + 42 and info.num_row_groups == len(groups)
    order = DataOrder(groups.start, groups.size, 11, True, 0.1, chunked=True)
    n = order.num_train_rows
    # 2 ranks × 32 rows for 3 steps, then 3 ranks × 32 rows (another global batch) to the end
    got, want, reads, val = read_epoch_part(
        info,
        groups,
        order,
        epoch=1,
        layouts=[(EpochLayout(n, 64, 8, 2), 0, 3), (EpochLayout(n - 192, 96, 8, 3), 192, None)],
        in_process=in_process,
    )
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g, w)
    seen = np.concatenate(got)
    assert len(seen) == n and np.array_equal(np.sort(seen), np.sort(order.row_ids(1, np.arange(n))))
    assert np.array_equal(np.sort(val), order.unit_rows(order.val_units))
    # row groups of 8 against shares of 32: the first group's ranks read exactly what they
    # train on; after the restart the short last window (56 rows: 19/19/18) splits groups
    assert reads[:2] == [(96, 96), (96, 96)]
    read, used = np.sum(reads, axis=0)
    assert read <= 1.25 * used, reads


def test_rows_reader_gives_the_exact_permutation(ray_local, id_tokens):
    info = describe_dataset(id_tokens)
    groups = row_groups(info.path)
    order = DataOrder.by_rows(info.num_rows, 0.1, 11, True)
    n = order.num_train_rows
    got, want, reads, val = read_epoch_part(
        info, groups, order, epoch=0, layouts=[(EpochLayout(n, 64, 8, 2), 0, None)]
    )
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g, w)
    assert np.array_equal(np.sort(np.concatenate(got)), order.unit_rows(order.train_units))
    assert np.array_equal(np.sort(val), order.unit_rows(order.val_units))
    # an exact shuffle draws from all over the file: each rank reads every row group that
    # holds a row of its share (nearly all of them)
    for rank, (read, _) in enumerate(reads):
        half = len(want) // 2
        mine = np.concatenate(want[rank * half : (rank + 1) * half])
        assert read == 8 * len(np.unique(mine // 8)) >= 0.9 * ROWS, reads


def test_data_prepare_shuffles_with_ray_data_and_keeps_every_row(ray_local, tmp_path):
    inputs, _ = corpus(tmp_path)
    plain, mixed = tmp_path / "plain", tmp_path / "mixed"
    prepare_corpus(inputs, str(plain), seq_len=16, rows_per_group=8, progress=quiet)
    prepare_corpus(
        inputs, str(mixed), seq_len=16, rows_per_group=8, shuffle=True, seed=1, progress=quiet
    )
    a, b = rows_of(plain), rows_of(mixed)
    assert not np.array_equal(a, b)
    assert sorted(map(tuple, a)) == sorted(map(tuple, b))
    assert pq.ParquetFile(next(mixed.glob("*.parquet"))).metadata.row_group(0).num_rows == 8
    assert describe_dataset(str(mixed)).vocab_size == 257
