import pytest

from rayacc.engine import TrainState


def test_round_trip_and_advance():
    s = TrainState()
    s.advance(samples=256, items=256, skipped=False)
    s.advance(samples=256, items=250, skipped=True)
    assert (s.optimizer_step, s.samples_seen, s.items_seen, s.skipped_steps) == (2, 512, 506, 1)
    assert s.epoch_sample_offset == 512
    t = TrainState()
    t.load_state_dict(s.state_dict())
    assert t == s
    t.start_epoch(1)
    assert (t.epoch, t.epoch_sample_offset, t.samples_seen) == (1, 0, 512)


def test_unknown_keys_are_refused():
    with pytest.raises(ValueError, match="unknown TrainState keys"):
        TrainState().load_state_dict({"optimizer_step": 3, "step": 3})
