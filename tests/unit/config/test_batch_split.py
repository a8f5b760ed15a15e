import pytest

from rayacc.config.batch_split import even_shares
from rayacc.engine import BatchSplit, BatchSplitError, resolve_batch_split


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        (dict(num_workers=2, global_batch_size=256, micro_batch_size=32), (256, 32, 4, 2)),
        (dict(num_workers=1, global_batch_size=256, micro_batch_size=32), (256, 32, 8, 1)),
        (dict(num_workers=4, global_batch_size=256, micro_batch_size=32), (256, 32, 2, 4)),
        (dict(num_workers=2, global_batch_size=256, grad_accum_steps=8), (256, 16, 8, 2)),
        (dict(num_workers=2, global_batch_size=256), (256, 128, 1, 2)),
        (dict(num_workers=2, micro_batch_size=8, grad_accum_steps=3), (48, 8, 3, 2)),
        (dict(num_workers=3, micro_batch_size=8), (24, 8, 1, 3)),
        (
            dict(num_workers=2, global_batch_size=64, micro_batch_size=8, grad_accum_steps=4),
            (64, 8, 4, 2),
        ),
    ],
)
def test_valid_plans(kw, expected):
    plan = resolve_batch_split(**kw)
    assert (
        plan.global_batch_size,
        plan.micro_batch_size,
        plan.grad_accum_steps,
        plan.num_workers,
    ) == expected
    assert (
        plan.global_batch_size == plan.micro_batch_size * plan.grad_accum_steps * plan.num_workers
    )


def test_plan_keeps_global_batch_when_workers_change():
    plans = [
        resolve_batch_split(num_workers=w, global_batch_size=96, micro_batch_size=4)
        for w in (1, 2, 3, 4, 6)
    ]
    assert {p.global_batch_size for p in plans} == {96}
    assert [p.grad_accum_steps for p in plans] == [24, 12, 8, 6, 4]


def test_describe():
    assert (
        BatchSplit(256, 32, 4, 2).describe() == "global batch 256 = micro 32 × accum 4 × workers 2"
    )
    assert BatchSplit(256, 32, 4, 2).samples_per_worker == 128


def raises(**kw) -> BatchSplitError:
    with pytest.raises(BatchSplitError) as info:
        resolve_batch_split(**kw)
    return info.value


def test_indivisible_micro_suggests_nearest_valid_values():
    err = raises(num_workers=2, global_batch_size=250, micro_batch_size=32)
    assert err.field == "batch.micro_batch_size"
    assert "125" in err.problem
    assert "set batch.micro_batch_size to 25 or 125" in err.fix
    assert "batch.global_batch_size to 192 or 256" in err.fix


def test_global_not_divisible_by_workers():
    err = raises(num_workers=3, global_batch_size=256, micro_batch_size=8)
    assert err.field == "batch.global_batch_size"
    assert "scaling.num_workers=3" in err.problem
    assert "255 or 258" in err.fix


def test_inconsistent_triple_names_all_fields_and_derivation():
    err = raises(num_workers=2, global_batch_size=256, micro_batch_size=32, grad_accum_steps=3)
    assert err.field == "batch.global_batch_size"
    for name in ("batch.micro_batch_size", "batch.grad_accum_steps", "scaling.num_workers", "192"):
        assert name in err.problem
    assert "it would be 4" in err.fix and "batch.global_batch_size=192" in err.fix


def test_micro_larger_than_worker_share():
    err = raises(num_workers=4, global_batch_size=64, micro_batch_size=32)
    assert err.field == "batch.micro_batch_size"
    assert "at most 16" in err.fix


def test_accum_not_dividing_worker_share():
    err = raises(num_workers=2, global_batch_size=64, grad_accum_steps=5)
    assert err.field == "batch.grad_accum_steps"
    assert "4 or 8" in err.fix


def test_nothing_given():
    err = raises(num_workers=2)
    assert "batch.global_batch_size" in str(err)


@pytest.mark.parametrize(
    "field", ["num_workers", "global_batch_size", "micro_batch_size", "grad_accum_steps"]
)
def test_non_positive_values(field):
    kw = dict(num_workers=2, global_batch_size=64, micro_batch_size=8)
    kw[field] = 0
    err = raises(**kw)
    assert field in err.field and "positive" in err.problem


def test_error_is_a_value_error_with_the_fix_in_its_message():
    with pytest.raises(ValueError, match=r"Fix: set batch.micro_batch_size to"):
        resolve_batch_split(num_workers=2, global_batch_size=100, micro_batch_size=7)


def test_elastic_plans_keep_the_global_batch_or_follow_the_workers():
    from rayacc.config.batch_split import split_for_workers

    base = resolve_batch_split(num_workers=3, global_batch_size=96, micro_batch_size=32)

    def elastic_sizes(base, lo, hi, policy):
        return {w: split_for_workers(base, w, policy) for w in range(lo, hi + 1)}

    kept = elastic_sizes(base, 1, 4, "keep_global_batch")
    assert kept[1] == BatchSplit(96, 32, 3, 1)
    assert kept[2] == BatchSplit(96, 24, 2, 2)  # 48 per worker: micro re-derived to 24
    assert kept[3] == base
    assert kept[4] == BatchSplit(96, 24, 1, 4)
    followed = elastic_sizes(base, 1, 3, "keep_micro_batch")
    assert [p.global_batch_size for p in followed.values()] == [32, 64, 96]
    assert {p.grad_accum_steps for p in followed.values()} == {1}
    # 96 over 5 ranks: 20 + 19 × 4, each rank in the largest share's 2 micro-steps of ≤ 32
    five = split_for_workers(base, 5, "keep_global_batch")
    assert five == BatchSplit(96, 20, 1, 5, shares=(20, 19, 19, 19, 19))
    assert five.rank_shares == five.shares and sum(five.shares) == 96
    assert "96 = 20 + 19 + 19 + 19 + 19 rows over workers 5" in five.describe()
    with pytest.raises(BatchSplitError, match="cannot be kept at 97 workers"):
        split_for_workers(base, 97, "keep_global_batch")


@pytest.mark.parametrize("g", [7, 32, 96, 101])
@pytest.mark.parametrize("micro", [1, 3, 4, 32])
def test_any_elastic_size_up_to_the_global_batch_keeps_it(g, micro):
    # every size in [1, G] runs; every rank the same micro-steps, none above the micro-batch
    from rayacc.config.batch_split import split_for_workers

    for w in range(1, g + 1):
        if micro == 1 and g % w:
            # a smaller share would run an empty micro-step: the one split no size can run
            with pytest.raises(BatchSplitError, match="micro-batch_size to 2|2 or more"):
                split_for_workers(BatchSplit(g, micro, 1, 1), w, "keep_global_batch")
            continue
        split = split_for_workers(BatchSplit(g, micro, 1, 1), w, "keep_global_batch")
        assert sum(split.rank_shares) == g and len(split.rank_shares) == w
        assert max(split.rank_shares) - min(split.rank_shares) <= 1
        assert split.micro_batch_size <= micro
        k = split.grad_accum_steps
        assert all(-(-share // split.micro_batch_size) <= k for share in split.rank_shares)
        assert all(share >= k for share in split.rank_shares)  # no empty micro-batch


def test_an_elastic_runs_most_workers_may_leave_the_global_batch_uneven():
    split = resolve_batch_split(
        num_workers=3, global_batch_size=32, micro_batch_size=4, uneven=True
    )
    assert split == BatchSplit(32, 4, 3, 3, shares=(11, 11, 10))
    with pytest.raises(BatchSplitError, match="larger than the largest worker's share"):
        resolve_batch_split(num_workers=3, global_batch_size=32, micro_batch_size=16, uneven=True)
    with pytest.raises(BatchSplitError, match="does not split evenly"):
        resolve_batch_split(num_workers=3, global_batch_size=32, micro_batch_size=4)


@pytest.mark.parametrize("g", [7, 16, 25, 101])
@pytest.mark.parametrize("micro", [2, 3, 6])
def test_a_fixed_count_splits_as_an_elastic_run_at_that_size(g, micro):
    """A fixed `scaling.num_workers` that does not divide the global batch takes the shares an
    elastic run keeping it takes at that size (16 over 3 ran inside [3, 3]; over 3, refused)."""
    from rayacc.config import TrainConfig
    from rayacc.run.quantities import split_at

    def cfg(workers) -> TrainConfig:
        return TrainConfig.from_dict({"batch": {"global_batch_size": g, "micro_batch_size": micro},
                                      "scaling": {"num_workers": workers}})  # fmt: skip

    for w in range(1, min(g, 5) + 1):
        try:
            elastic = split_at(cfg([1, w]), w)
        except (BatchSplitError, ValueError):
            continue  # a micro-batch above the largest share: refused alike (checked above)
        fixed = split_at(cfg(w), w)
        assert fixed == elastic, (g, micro, w)
        assert fixed.rank_shares == even_shares(g, w)
