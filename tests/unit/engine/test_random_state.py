"""A rank's random stream by the layout's rule (engine/random_state.py): one stream per
data-parallel rank, restored by its place (not by the global rank), seeded anew from the step
where the data-parallel ranks changed; a checkpoint from before states carried their place
reads as one stream per rank."""

from __future__ import annotations

import pytest
import torch

from rayacc.engine.random_state import RandomStreams

CPU = torch.device("cpu")


def _draws(n: int = 4) -> torch.Tensor:
    return torch.rand(n)


def _saved(streams: int, tp: int) -> list[dict]:
    """Every rank's state of a (streams × tp) layout, in global rank order, each stream a
    little way in."""
    out = []
    for rank in range(streams * tp):
        s = RandomStreams(3, rank // tp, streams, CPU)
        s.start()
        _draws(rank // tp + 1)
        out.append(s.state())
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_each_rank_restores_its_data_parallel_streams_state(tp):
    saved = _saved(2, tp)
    for stream in range(2):
        RandomStreams(3, stream, 2, CPU).start()
        _draws(stream + 1)
        expected = _draws()
        # whatever this rank's global rank and tensor-parallel size now
        assert RandomStreams(3, stream, 2, CPU).restore(saved, step=5) == "restored"
        assert torch.equal(_draws(), expected)


def test_another_number_of_streams_seeds_each_anew_alike_on_its_ranks():
    saved = _saved(2, 2)
    got = []
    for _ in range(2):  # two ranks of one tensor-parallel group: one stream
        assert RandomStreams(3, 0, 1, CPU).restore(saved, step=5) == "reseeded"
        got.append(_draws())
    assert torch.equal(got[0], got[1])
    RandomStreams(3, 1, 2, CPU).restore([], step=5)
    other = _draws()
    RandomStreams(3, 1, 2, CPU).restore([], step=6)
    assert not torch.equal(other, _draws()), "the step seeds the fresh stream"


def test_a_checkpoint_without_stream_places_reads_as_one_stream_per_rank():
    legacy = [{k: v for k, v in s.items() if k in ("cpu", "cuda")} for s in _saved(2, 1)]
    RandomStreams(3, 1, 2, CPU).start()
    _draws(2)
    expected = _draws()
    assert RandomStreams(3, 1, 2, CPU).restore(legacy, step=5) == "restored"
    assert torch.equal(_draws(), expected)


@pytest.mark.parametrize(
    "saved", [{"cpu": 1}, [1], [{"cpu": "x"}], [{"cpu": torch.zeros(3)}], [{"cuda": None}]]
)
def test_a_damaged_list_of_states_is_refused_before_anything_is_restored(saved):
    with pytest.raises(ValueError):
        RandomStreams.check(saved)
