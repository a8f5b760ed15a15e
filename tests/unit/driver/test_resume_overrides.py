"""A resume runs the job with the overrides the run was started with, and over them only those
given now; it says each kept, changed or masked one."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rayacc.driver.resume import override_key, resumed_overrides


def test_started_overrides_are_kept_and_those_given_now_win():
    r = resumed_overrides(
        ["train.max_steps=100", "optim.lr=0.01", "seed=3"], ["optim.lr=0.02", "train.epochs=2"]
    )
    assert r.overrides == ["train.max_steps=100", "seed=3", "optim.lr=0.02", "train.epochs=2"]
    assert r.kept == ["train.max_steps=100", "seed=3"]
    assert r.changed == ["optim.lr: 0.01 → 0.02"]
    assert "kept from the run's start: train.max_steps=100, seed=3" in r.lines()


def test_a_masked_override_is_not_applied_again_and_is_said():
    r = resumed_overrides(["tracking.tracking_uri=http://u:***@host"], [])
    assert r.overrides == [] and r.dropped == ["tracking.tracking_uri"]
    assert "give it again" in r.lines()[0]
    # given again now: used, nothing to say
    again = resumed_overrides(
        ["tracking.tracking_uri=http://u:***@host"], ["tracking.tracking_uri=x"]
    )
    assert again.overrides == ["tracking.tracking_uri=x"] and not again.dropped


keys = st.sampled_from(["a.b", "a.c", "seed", "train.max_steps"])
overrides = st.lists(st.tuples(keys, st.integers(0, 3)).map(lambda kv: f"{kv[0]}={kv[1]}"))


@given(overrides, overrides)
def test_the_last_value_of_each_key_is_the_one_given_now_else_the_started_one(started, now):
    r = resumed_overrides(started, now)
    last = {override_key(o): o for o in [*started, *now]}
    final = {override_key(o): o for o in r.overrides}
    assert final == last
