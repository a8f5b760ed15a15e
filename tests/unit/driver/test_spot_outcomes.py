"""The spot test accepts each outcome the product may legitimately produce for a notice, and no
other: the patterns it reads the console and the tag with, against the product's own lines."""

from __future__ import annotations

import re

import pytest

from rayacc.observe.events import PreemptionNotice
from tests.support.services.cluster import notice_outcomes


def notice(step: int, checkpoint_s: float | None, too_short: bool = False) -> PreemptionNotice:
    return PreemptionNotice(
        step=step,
        nodes=("a1b2c3d4e5f6a7b8",),
        ranks=(1,),
        seconds_left=10.7,
        deadline_given=True,
        checkpoint_s=checkpoint_s,
        checkpoint_step=step if not too_short else 8,
        too_short=too_short,
    )


@pytest.mark.parametrize(
    ("event", "accepted"),
    [
        (notice(12, checkpoint_s=None), True),  # the notice at a periodic checkpoint's step
        (notice(13, checkpoint_s=0.4), True),  # between two: one written at the notice
        (notice(13, checkpoint_s=None, too_short=True), False),  # none: steps recomputed
    ],
    ids=["already-written", "written-at-notice", "too-short"],
)
def test_the_spot_test_reads_every_legitimate_outcome_of_a_notice(event, accepted):
    console, tag = notice_outcomes(event.step)
    assert bool(re.search(console, event.console_line())) is accepted, event.console_line()
    assert bool(re.search(tag, event.describe())) is accepted, event.describe()
    # another step's notice is not this one's
    other_console, other_tag = notice_outcomes(event.step + 1)
    assert not re.search(other_console, event.console_line())
    assert not re.search(other_tag, event.describe())
