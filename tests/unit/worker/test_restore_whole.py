"""A checkpoint is loaded whole before the run trusts it (worker/checkpoint.py): every part —
model and optimizer state, schedule, train state, random state, lineage — is read, checked and
loaded inside the pass-over, so any part's failure passes the checkpoint over (marked, said) to
the one before; where none loads, the run ends naming each folder and why (NoCheckpointLoads,
exit 2 on the driver), now and at every later start; retention keeps the newest good
checkpoints and never counts a passed-over one. One process, a real local storage."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from rayacc.checkpoint import RunCheckpoints, write_checkpoint
from rayacc.checkpoint.format import checkpoint_meta, folder_name
from rayacc.checkpoint.reader import PASSED_OVER_FILE
from rayacc.config.batch_split import BatchSplit
from rayacc.engine import TrainState
from rayacc.engine.parallel.state import WholeState
from rayacc.engine.random_state import RandomStreams
from rayacc.worker.checkpoint import Checkpointer, NoCheckpointLoads, WorkerParts, raised_by_ranks


@dataclass
class _OneProcess:
    """A replicated model's strategy parts as a rank holds them: its model and the whole-state
    format every replicated strategy writes."""

    model: nn.Module
    state: WholeState


def _parts(seed: int = 0) -> WorkerParts:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return WorkerParts(
        _OneProcess(model, WholeState()),
        optimizer,
        {"schedule": schedule, "train_state": TrainState()},
        rank=0,
        world=1,
        device=torch.device("cpu"),
        streams=RandomStreams(7, 0, 1, torch.device("cpu")),
    )


def _write(run: Path, step: int, *, break_part: str | None = None, weight: float = 0.0) -> Path:
    """A whole checkpoint of the one-process run at `step` (every part as a rank writes it),
    with the part `break_part` written in a form its loader refuses."""
    parts = _parts()
    with torch.no_grad():
        parts.strategy.model.weight.fill_(weight)
    state = TrainState()
    state.optimizer_step = step
    saved = {
        "model": parts.strategy.model.state_dict(),
        "optimizer": parts.optimizer.state_dict(),
        "schedule": parts.stateful["schedule"].state_dict(),
        "train_state": state.state_dict(),
        "rng": [parts.streams.state()],
    }
    broken = {
        "model": {"no such weight": torch.zeros(1)},
        "optimizer": {"state": {}, "param_groups": []},
        "schedule": ["not", "a", "state dict"],
        "train_state": {"optimizer_step": "two"},
        "rng": [{"cpu": torch.zeros(3)}],
    }
    if break_part is not None:
        saved[break_part] = broken[break_part]
    meta = checkpoint_meta({}, BatchSplit(4, 2, 2, 1), state, 1, None, "whole")
    return write_checkpoint(
        run / folder_name(step), state=saved, description={"config": {}, "dataset": {}}, meta=meta
    )


PARTS = ["model", "optimizer", "schedule", "train_state", "rng"]


@pytest.mark.parametrize("part", PARTS)
def test_a_checkpoint_any_part_of_which_fails_is_passed_over_to_the_one_before(tmp_path, part):
    run = tmp_path / "runs" / "r"
    _write(run, 2, weight=2.0)
    _write(run, 4, break_part=part, weight=4.0)
    parts = _parts(seed=1)
    checkpointer = Checkpointer(str(tmp_path / "runs"), "r", parts)
    meta = checkpointer.restore()
    assert meta is not None and meta["optimizer_step"] == 2, part
    # every part from the checkpoint at step 2, none from the one passed over
    assert torch.equal(parts.strategy.model.weight, torch.full((2, 3), 2.0)), part
    assert parts.stateful["train_state"].optimizer_step == 2, part
    assert len(checkpointer.passed_over) == 1 and folder_name(4) in checkpointer.passed_over[0]
    assert (run / folder_name(4) / PASSED_OVER_FILE).is_file(), part
    assert RunCheckpoints(str(tmp_path / "runs"), "r").latest().step == 2


@pytest.mark.parametrize("part", PARTS)
def test_no_checkpoint_that_loads_ends_the_run_naming_each_folder_now_and_later(tmp_path, part):
    run = tmp_path / "runs" / "r"
    _write(run, 2, break_part=part)
    _write(run, 4, break_part=part)
    with pytest.raises(NoCheckpointLoads) as caught:
        Checkpointer(str(tmp_path / "runs"), "r", _parts()).restore()
    said = str(caught.value)
    assert folder_name(2) in said and folder_name(4) in said and "Fix:" in said, said
    # the next group (a restart) does not start over silently either
    with pytest.raises(NoCheckpointLoads) as again:
        Checkpointer(str(tmp_path / "runs"), "r", _parts()).restore()
    assert "passed over by an earlier restore" in str(again.value)
    assert folder_name(2) in str(again.value) and folder_name(4) in str(again.value)


def test_when_none_loads_a_folder_of_random_bytes_is_named_beside_the_refused(tmp_path):
    """Every checkpoint of the run fails: the weights of one do not fit, another's state is
    random bytes (its digest does not match). The message named the first only."""
    run = tmp_path / "runs" / "r"
    _write(run, 2)
    (run / folder_name(2) / "state.pt").write_bytes(os.urandom(512))
    _write(run, 4, break_part="model")
    with pytest.raises(NoCheckpointLoads) as caught:
        Checkpointer(str(tmp_path / "runs"), "r", _parts()).restore()
    said = str(caught.value)
    assert folder_name(4) in said and folder_name(2) in said, said


def test_a_run_with_no_checkpoint_or_only_one_cut_short_starts_from_the_beginning(tmp_path):
    assert Checkpointer(str(tmp_path / "runs"), "r", _parts()).restore() is None
    run = tmp_path / "runs" / "r"
    _write(run, 2)
    (run / folder_name(2) / "model.json").unlink()  # a write cut short: not whole
    assert Checkpointer(str(tmp_path / "runs"), "r", _parts()).restore() is None


def test_retention_keeps_the_newest_good_checkpoints_and_never_counts_a_passed_over_one(
    tmp_path,
):
    run = tmp_path / "runs" / "r"
    for step in (2, 3):
        _write(run, step)
    _write(run, 4, break_part="train_state")
    checkpointer = Checkpointer(str(tmp_path / "runs"), "r", _parts(), keep=2)
    assert checkpointer.restore()["optimizer_step"] == 3
    checkpointer.prune()
    # two good ones (2 and 3): nothing goes, though three folders are there
    assert sorted(p.name for p in run.iterdir()) == [folder_name(s) for s in (2, 3, 4)]
    _write(run, 5)
    checkpointer.prune()
    # good: 3 and 5 kept; 2 goes; 4, passed over after the oldest kept, stays as evidence
    assert sorted(p.name for p in run.iterdir()) == [folder_name(s) for s in (3, 4, 5)]
    _write(run, 6)
    checkpointer.prune()
    assert sorted(p.name for p in run.iterdir()) == [folder_name(s) for s in (5, 6)]
    assert [c.step for c in RunCheckpoints(str(tmp_path / "runs"), "r").list()] == [5, 6]


def test_the_driver_finds_the_ranks_refusal_inside_ray_trains_failure():
    """What Ray Train raises when the ranks' restore ends with NoCheckpointLoads: a
    WorkerGroupError holding each rank's error, a task error wrapping it (its `cause`)."""
    from ray.exceptions import RayTaskError
    from ray.train.v2.api.exceptions import WorkerGroupError

    refused = NoCheckpointLoads("no checkpoint of run /runs/r loads: step 4 (KeyError)")
    wrapped = RayTaskError("train_fn", "Traceback …", refused)
    failure = WorkerGroupError("rank 0 failed", {0: wrapped, 1: RuntimeError("gloo: peer gone")})
    found = raised_by_ranks(failure, (NoCheckpointLoads,))
    assert found is not None and "step 4" in str(found)
    assert (
        raised_by_ranks(WorkerGroupError("x", {0: RuntimeError("oom")}), (NoCheckpointLoads,))
        is None
    )
