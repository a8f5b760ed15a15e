import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

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

    from rayacc.data.rows import LocalRows

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


# ----------------------------------------------------------------------------- chunk order
def chunk_order(sizes, val_fraction=0.0, seed=5, shuffle=True):
    from rayacc.data.order import DataOrder

    sizes = np.asarray(sizes, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return DataOrder(starts, sizes, seed, shuffle, val_fraction, chunked=True)


def test_rows_order_is_the_per_row_permutation():
    from rayacc.data.order import DataOrder

    order = DataOrder.by_rows(100, 0.1, seed=3, shuffle=True)
    train, val = split_train_val(100, 0.1, seed=3)
    assert np.array_equal(order.unit_rows(order.val_units), val)
    for epoch in (0, 4):
        assert np.array_equal(
            order.row_ids(epoch, np.arange(90)), epoch_order(train, epoch, 3, shuffle=True)
        )


def test_chunk_order_covers_every_training_row_once_in_runs_of_whole_chunks():
    sizes = [7, 16, 3, 16, 16, 9, 16, 5]
    order = chunk_order(sizes, val_fraction=0.2)
    val = order.unit_rows(order.val_units)
    assert len(order.val_units) == round(8 * 0.2)
    for epoch in (0, 1):
        ids = order.row_ids(epoch, np.arange(order.num_train_rows))
        assert np.array_equal(np.sort(np.concatenate([ids, val])), np.arange(sum(sizes)))
        # each chunk's rows are consecutive positions, shuffled inside the chunk
        chunk = np.searchsorted(np.cumsum(sizes), ids, side="right")
        assert (np.diff(chunk) != 0).sum() == len(order.train_units) - 1
    a, b = (order.row_ids(e, np.arange(order.num_train_rows)) for e in (0, 1))
    assert not np.array_equal(a, b), "another epoch, another order"
    stored = chunk_order(sizes, shuffle=False)
    assert np.array_equal(stored.row_ids(0, np.arange(sum(sizes))), np.arange(sum(sizes)))


def test_a_restart_at_another_size_continues_the_epoch_without_repeating_a_sample():
    """Rows (sample ids) consumed by 2 ranks for 3 steps, then by 3 ranks from that sample
    position with another global batch: every training row of the epoch exactly once."""
    order = chunk_order([8] * 25, val_fraction=0.1)
    n = order.num_train_rows
    seen = []
    before = EpochLayout(n, 32, 4, 2)
    for rank in range(2):
        seen.append(order.row_ids(2, before.rank_positions(0, rank, stop_step=3)))
    offset = 3 * 32
    after = EpochLayout(n - offset, 48, 8, 3)
    for rank in range(3):
        seen.append(order.row_ids(2, offset + after.rank_positions(0, rank)))
    seen = np.concatenate(seen)
    assert len(seen) == n == len(np.unique(seen))
    assert np.array_equal(np.sort(seen), np.sort(order.row_ids(2, np.arange(n))))


def test_units_of_lists_the_chunks_in_first_need_with_the_last_window_that_needs_them():
    order = chunk_order([10, 10, 10, 10], shuffle=False)
    units, last = order.units_of(0, np.array([0, 12, 25]), np.array([5, 22, 40]))
    assert units.tolist() == [0, 1, 2, 3]
    assert last.tolist() == [0, 1, 2, 2]


@pytest.mark.parametrize(("group_rows", "factor"), [(4, 1.0), (12, 1.25), (48, 2.0)])
def test_reads_per_epoch_follow_the_row_group_size(group_rows, factor):
    """Rows the cluster reads per epoch over rows trained on, with each rank's share of a window
    32 rows: about once when row groups are small against it, twice when a row group straddles
    both ranks' shares of every window."""
    from rayacc.driver.prelaunch import read_factor

    order = chunk_order([group_rows] * (1536 // group_rows))
    layout = EpochLayout(order.num_train_rows, 64, 8, 2)
    assert read_factor(order, layout) == pytest.approx(factor)


def test_prepare_warns_when_row_groups_are_too_large_for_the_read_once_order(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rayacc import TrainConfig
    from rayacc.driver.prelaunch import prepare

    path = tmp_path / "tokens.parquet"
    rows = [[i % 50, (i + 1) % 50, 3] for i in range(1536)]
    pq.write_table(
        pa.table({"tokens": pa.array(rows, pa.list_(pa.uint16()))}), path, row_group_size=48
    )
    cfg = TrainConfig.from_dict(
        {
            "model": {"name": "gpt", "n_layer": 1, "n_head": 1, "n_embd": 8, "block_size": 4},
            "data": {"source": str(path), "order": "chunks", "val_fraction": 0.0, "seq_len": 4},
            "batch": {"global_batch_size": 64, "micro_batch_size": 8},
            "scaling": {"num_workers": 2},
        }
    )
    prep = prepare(cfg)
    assert any(
        "reads each row 2.00× per epoch" in w and "at most 8 rows" in w for w in prep.warnings
    ), prep.warnings
    assert any("data order: chunks (32 row groups" in n for n in prep.notes), prep.notes
    small = cfg.model_copy(update={"data": cfg.data.model_copy(update={"order": "rows"})})
    assert not any("reads each row" in w for w in prepare(small).warnings)
    old = cfg.model_copy(update={"data": cfg.data.model_copy(update={"materialize": False})})
    assert any("data.materialize no longer has an effect" in w for w in prepare(old).warnings)


def test_a_short_row_group_does_not_shift_the_windows_off_the_row_groups():
    """A file's last row group is usually short; placed early in an epoch it would shift every
    later window by its size, and each rank would read one row group more per window. Short
    units go to the end of each shuffled epoch."""
    from rayacc.driver.prelaunch import read_factor

    order = chunk_order([8] * 200 + [4] + [8] * 199)
    layout = EpochLayout(order.num_train_rows, 64, 8, 2)
    assert read_factor(order, layout) < 1.01
    for epoch in (0, 1):
        units, _ = order._epoch(epoch)
        assert units[-1] == 200


@pytest.mark.parametrize(
    ("workers", "state", "expected"),
    [
        # 49 rows, G 16: on 1 worker 3 windows and a short one of 1 row
        (1, {}, [(0, 4), (1, 4)]),
        # stopped after 3 steps on 1 worker, resumed on 2: the row left is fewer than the
        # workers, so epoch 0 has no window and is left out (no rank asks for window 0 of it)
        (2, {"optimizer_step": 3, "epoch_sample_offset": 48}, [(1, 2)]),
        # no steps left
        (2, {"optimizer_step": 5, "epoch": 1, "epoch_sample_offset": 32}, []),
    ],
)
def test_remaining_epochs_leave_out_an_epoch_without_a_window(workers, state, expected):
    from rayacc.config import TrainConfig
    from rayacc.config.batch_split import BatchSplit
    from rayacc.engine import TrainState
    from rayacc.run.quantities import RunLength, remaining_epochs

    cfg = TrainConfig.from_dict(
        {
            "batch": {"global_batch_size": 16, "micro_batch_size": 4},
            "train": {"epochs": 2, "max_steps": 5 if state else None},
        }
    )
    plan = BatchSplit(16, 4, 4 // workers, workers)
    plans = remaining_epochs(RunLength.of(cfg), 49, TrainState(**state), plan, rank=workers - 1)
    assert [(p.epoch, p.steps) for p in plans] == expected
    for p in plans:
        assert len(p.lo) == p.steps and all(p.hi > p.lo)


@pytest.mark.parametrize(
    ("train", "steps", "epochs"),
    [
        # train.max_steps alone wins over the one epoch a run takes by default (4 steps each)
        ({"max_steps": 10}, 10, [(0, 4), (1, 4), (2, 2)]),
        ({}, 4, [(0, 4)]),
        # a number of epochs given bounds train.max_steps
        ({"max_steps": 10, "epochs": 1}, 4, [(0, 4)]),
        ({"max_steps": 3, "epochs": 2}, 3, [(0, 3)]),
        ({"epochs": 2}, 8, [(0, 4), (1, 4)]),
    ],
)
def test_max_steps_wins_over_the_default_epochs_and_a_given_epoch_count_bounds_it(
    train, steps, epochs
):
    from rayacc.config import TrainConfig
    from rayacc.config.batch_split import BatchSplit
    from rayacc.engine import TrainState
    from rayacc.observe.console import length_note
    from rayacc.run.quantities import (
        RunLength,
        epoch_layout,
        remaining_epochs,
        total_optimizer_steps,
    )

    cfg = TrainConfig.from_dict(
        {"batch": {"global_batch_size": 16, "micro_batch_size": 4}, "train": train}
    )
    split = BatchSplit(16, 4, 4, 1)
    layout = epoch_layout(RunLength.of(cfg), 49, split)
    assert total_optimizer_steps(RunLength.of(cfg), layout) == steps
    plans = remaining_epochs(RunLength.of(cfg), 49, TrainState(), split, rank=0)
    assert [(p.epoch, p.steps) for p in plans] == epochs
    note = length_note(cfg, layout.steps_per_epoch)
    assert (note == " (train.max_steps; 2.5 epochs of data)") == (train == {"max_steps": 10})


def test_an_epoch_without_a_window_ends_a_run_that_max_steps_alone_bounds():
    from rayacc.config import TrainConfig
    from rayacc.config.batch_split import BatchSplit
    from rayacc.engine import TrainState
    from rayacc.run.quantities import RunLength, remaining_epochs

    cfg = TrainConfig.from_dict(
        {"batch": {"global_batch_size": 16, "micro_batch_size": 4}, "train": {"max_steps": 9}}
    )
    # no rows: a whole epoch without a window ends the loop (no later epoch has one)
    plans = remaining_epochs(RunLength.of(cfg), 0, TrainState(), BatchSplit(16, 4, 4, 1), rank=0)
    assert plans == []


@st.composite
def layouts(draw):
    """Any layout the batch split accepts: G over 1–8 workers, even or uneven shares (each
    able to run the largest one's micro-steps), any micro-batch size, any row count."""
    workers = draw(st.integers(1, 8))
    g = draw(st.integers(workers, 64))
    micro = draw(st.integers(1, g))
    shares = ()
    if draw(st.booleans()) and workers > 1:
        cuts = sorted(draw(st.lists(st.integers(1, g - 1), min_size=workers - 1,
                                    max_size=workers - 1, unique=True)))  # fmt: skip
        shares = tuple(b - a for a, b in zip([0, *cuts], [*cuts, g], strict=True))
        assume(min(shares) >= -(-max(shares) // micro))
    elif g % workers:
        shares = tuple(g // workers + (1 if r < g % workers else 0) for r in range(workers))
        assume(min(shares) >= -(-max(shares) // micro))
    rows = draw(st.integers(0, 5 * g))
    last = draw(st.sampled_from(["short", "drop"]))
    return EpochLayout(rows, g, micro, workers, last, shares)


@settings(max_examples=400, deadline=None)
@given(layouts())
def test_no_micro_batch_exceeds_the_micro_batch_size_in_any_layout(layout):
    """The micro-batch bound as a property of the layout itself: every window (full, a short
    last one, even or uneven shares) runs the same number of micro-steps on every rank, none
    above the full window's (a pipeline's schedule), none empty, none above
    `micro_batch_size` (its memory); the windows take the epoch's rows in order, each once,
    the dropped ones at the end."""
    taken = []
    for s in range(layout.steps_per_epoch):
        parts = [layout.rank_window(s, r).micro_batches for r in range(layout.num_workers)]
        steps = {len(p) for p in parts}
        assert len(steps) == 1 and 0 < steps.pop() <= layout.micro_steps, (layout, s)
        sizes = [len(m) for p in parts for m in p]
        assert min(sizes) > 0 and max(sizes) <= layout.micro_batch_size, (layout, s, sizes)
        taken.append(window_samples(layout, s))
    got = np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)
    kept = layout.num_rows - layout.dropped_rows
    assert np.array_equal(got, np.arange(kept)), layout
    assert layout.dropped_rows < max(layout.global_batch_size, 1)


def test_a_short_window_over_ranks_it_does_not_divide_keeps_the_micro_batch():
    """25 rows, G 16, micro 4, 2 workers: the short window's 9 rows as 5 + 4, each rank in two
    micro-steps (one of 5 rows went past the micro-batch, and past a pipeline's buffers)."""
    layout = EpochLayout(25, 16, 4, 2)
    assert [len(m) for m in layout.rank_window(1, 0).micro_batches] == [3, 2]
    assert [len(m) for m in layout.rank_window(1, 1).micro_batches] == [2, 2]
    ones = EpochLayout(25, 16, 1, 2)
    assert (ones.short_window_rows, ones.dropped_rows) == (8, 1)
    assert "the last 1 rows are dropped" in ones.describe()
