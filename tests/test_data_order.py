import numpy as np
import pytest

from rayacc.data.order import EpochLayout, epoch_order, split_train_val


def test_split_is_seeded_disjoint_and_complete():
    train, val = split_train_val(100, 0.1, seed=3)
    assert len(val) == 10 and len(train) == 90
    assert set(train).isdisjoint(val) and set(train) | set(val) == set(range(100))
    again, _ = split_train_val(100, 0.1, seed=3)
    assert np.array_equal(train, again)
    other, _ = split_train_val(100, 0.1, seed=4)
    assert not np.array_equal(train, other)
    assert len(split_train_val(100, 0.0, seed=3)[1]) == 0


def test_epoch_order_depends_on_seed_and_epoch_only():
    ids = np.arange(50)
    a = epoch_order(ids, 1, 7, shuffle=True)
    assert np.array_equal(a, epoch_order(ids, 1, 7, shuffle=True))
    assert not np.array_equal(a, epoch_order(ids, 2, 7, shuffle=True))
    assert sorted(a) == list(range(50))
    assert np.array_equal(epoch_order(ids, 5, 7, shuffle=False), ids)


def window_samples(layout, step):
    """All positions of one window, gathered rank by rank, micro-batch by micro-batch."""
    return np.concatenate(
        [p for r in range(layout.num_workers) for p in layout.rank_window(step, r).micro_batches]
    )


@pytest.mark.parametrize(("workers", "micro"), [(1, 16), (2, 8), (2, 4), (4, 2), (4, 4), (8, 1)])
def test_same_global_batch_sees_the_same_samples_at_every_step(workers, micro):
    ref = EpochLayout(104, 32, 32, 1)
    layout = EpochLayout(104, 32, micro, workers)
    assert layout.steps_per_epoch == ref.steps_per_epoch == 4
    for s in range(layout.steps_per_epoch):
        assert np.array_equal(window_samples(layout, s), window_samples(ref, s))


def test_micro_step_parity_in_every_window():
    for rows in range(40, 80):
        for w in (2, 3, 4):
            g = 12 * w
            layout = EpochLayout(rows, g, 3, w)
            for s in range(layout.steps_per_epoch):
                counts = {len(layout.rank_window(s, r).micro_batches) for r in range(w)}
                assert len(counts) == 1, (rows, w, s, counts)
                assert all(
                    len(p) > 0 for r in range(w) for p in layout.rank_window(s, r).micro_batches
                )


def test_short_last_window_and_drop_policy():
    short = EpochLayout(70, 32, 8, 2, "short")
    assert (short.full_windows, short.short_window_rows, short.steps_per_epoch) == (2, 6, 3)
    assert short.rank_window(2, 0).window_samples == 6
    assert np.array_equal(window_samples(short, 2), np.arange(64, 70))
    assert "short last window of 6 rows" in short.describe()
    drop = EpochLayout(70, 32, 8, 2, "drop")
    assert (drop.steps_per_epoch, drop.dropped_rows) == (2, 6)
    assert "dropped" in drop.describe()
    tiny = EpochLayout(65, 32, 8, 2, "short")
    assert tiny.short_window_rows == 0 and tiny.dropped_rows == 1
    assert "fewer than 2 workers" in tiny.describe()


def test_rank_positions_cover_each_rank_share_from_a_step():
    layout = EpochLayout(70, 32, 8, 2)
    all_positions = np.sort(np.concatenate([layout.rank_positions(0, r) for r in range(2)]))
    assert np.array_equal(all_positions, np.arange(70))
    from_step_1 = np.concatenate([layout.rank_positions(1, r) for r in range(2)])
    assert np.array_equal(np.sort(from_step_1), np.arange(32, 70))
    with pytest.raises(IndexError):
        layout.rank_window(3, 0)


@pytest.mark.parametrize("fmt", ["classification", "tokens", "token_lists"])
def test_take_split_equals_one_take_per_micro_batch(fmt):
    import torch

    from rayacc.runner.ingest import LocalRows

    g = torch.Generator().manual_seed(0)
    if fmt == "classification":
        rows = LocalRows(fmt, features=torch.randn(20, 3, generator=g), labels=torch.arange(20))
    elif fmt == "tokens":
        rows = LocalRows("tokens", tokens=torch.randint(0, 50, (20, 6), generator=g))
    else:
        lists = [np.arange(2 + i % 5) + i for i in range(20)]
        rows = LocalRows("tokens", token_lists=lists)
    index = np.array([7, 3, 19, 0, 12, 5, 5, 8, 1])
    sizes = [4, 4, 1]
    parts = rows.take_split(index, sizes)
    assert len(parts) == 3
    for part, lo, hi in zip(parts, [0, 4, 8], [4, 8, 9], strict=True):
        alone = rows.take(index[lo:hi])
        assert part.keys() == alone.keys()
        for key in part:
            assert torch.equal(part[key], alone[key]), (fmt, key, lo)
