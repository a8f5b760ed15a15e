"""A run name means one run: checked on the driver before Ray starts (no Ray here)."""

from __future__ import annotations

import pytest

from rayacc.config import TrainConfig
from rayacc.data.sources import DataError
from rayacc.runner.driver import locate_run


def cfg(storage, name=None) -> TrainConfig:
    return TrainConfig.from_dict(
        {
            "batch": {"global_batch_size": 32, "micro_batch_size": 4},
            "run": {"storage_path": str(storage), "name": name},
        }
    )


def test_a_new_run_may_not_take_the_name_of_an_existing_one(tmp_path):
    (tmp_path / "exp" / "checkpoint_step00000004").mkdir(parents=True)
    with pytest.raises(DataError, match="already names a run") as err:
        locate_run(cfg(tmp_path, "exp"), resume=False)
    assert "--resume" in str(err.value) and "run.name" in str(err.value)
    assert locate_run(cfg(tmp_path, "exp"), resume=True).name == "exp"


def test_resume_needs_an_existing_run_of_that_name(tmp_path):
    (tmp_path / "exp").mkdir()
    with pytest.raises(DataError, match="no run named run.name='exq'") as err:
        locate_run(cfg(tmp_path, "exq"), resume=True)
    assert "exp" in str(err.value), "the runs that exist are listed"
    assert locate_run(cfg(tmp_path, "exq"), resume=False).name == "exq"


def test_unnamed_runs_get_fresh_names(tmp_path):
    a, b = (locate_run(cfg(tmp_path), resume=False) for _ in range(2))
    assert a.name != b.name
