"""The helper that spawns ranks: a crash in the interpreter's teardown, after a rank's work is
saved, is not a failed test; a crash during the work still is, and says which ranks saved."""

from __future__ import annotations

import pytest

from tests.support.ranks import spawn_targets
from tests.support.ranks.engine_helpers import spawn_ranks


def test_a_crash_in_teardown_after_the_work_is_not_a_failure(tmp_path):
    ranks = spawn_ranks(spawn_targets.saves_then_aborts_at_exit, 2, tmp_path, "teardown check")
    assert [r["rank"] for r in ranks] == [0, 1]


def test_a_crash_during_the_work_fails_and_names_the_ranks_that_saved(tmp_path):
    with pytest.raises(pytest.fail.Exception) as failed:
        spawn_ranks(spawn_targets.aborts_before_saving, 2, tmp_path, "crash check")
    message = str(failed.value)
    assert "signal SIGABRT" in message, message
    # rank 0 may or may not have saved before the loss of rank 1 was noticed; rank 1 never did
    saved = message.rsplit("ranks that saved their results: ", 1)[1].rstrip(")")
    assert saved in ("[]", "[0]"), message
