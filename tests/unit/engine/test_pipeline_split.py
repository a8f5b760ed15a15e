"""How a model is cut into pipeline stages: contiguous runs of its units balanced by
parameter count (the slowest stage sets the pace), each rank's stages under a loop and a V,
and the built-in GPT cut down to a stage keeping the whole model's names."""

from __future__ import annotations

import itertools

import pytest
import torch

from rayacc.engine.parallel.pipeline import balanced_runs, stage_indices, stages_per_rank
from rayacc.models.gpt import GPT


def best_by_search(weights, parts):
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_runs_are_the_best_contiguous_balance(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 9, (1,), generator=g))
    parts = int(torch.randint(1, n + 1, (1,), generator=g))
    weights = torch.randint(1, 50, (n,), generator=g).tolist()
    runs = balanced_runs(weights, parts)
    assert [u for r in runs for u in r] == list(range(n))  # contiguous, every unit once
    assert all(len(r) for r in runs) and len(runs) == parts
    assert max(sum(weights[u] for u in r) for r in runs) == best_by_search(weights, parts)


def test_more_stages_than_units_are_refused():
    with pytest.raises(ValueError, match="3 units cannot make 4 pipeline stages"):
        balanced_runs([1, 2, 3], 4)


def test_each_rank_holds_its_stages():
    assert [stage_indices("1f1b", r, 2, 1) for r in range(2)] == [[0], [1]]
    assert [stage_indices("interleaved_1f1b", r, 2, 3) for r in range(2)] == [[0, 2, 4], [1, 3, 5]]
    # the V: the first and the last stage on rank 0
    assert [stage_indices("zbv", r, 2, 2) for r in range(2)] == [[0, 3], [1, 2]]
    assert [stages_per_rank(s, 3) for s in ("gpipe", "1f1b", "interleaved_1f1b", "zbv")] == [
        1, 1, 3, 2]  # fmt: skip
    with pytest.raises(ValueError, match="pipeline_schedule='dualpipe'"):
        stages_per_rank("dualpipe")


def test_a_stage_of_the_gpt_keeps_the_whole_models_names_and_values():
    whole = GPT(16, 8, 3, 2, 8, seed=1)
    ids = torch.randint(0, 16, (2, 8))
    names = dict(whole.named_parameters(remove_duplicate=False))
    first = GPT(16, 8, 3, 2, 8, seed=1).keep_pipeline_units(range(0, 2))
    middle = GPT(16, 8, 3, 2, 8, seed=1).keep_pipeline_units(range(2, 3))
    last = GPT(16, 8, 3, 2, 8, seed=1).keep_pipeline_units(range(3, 5))
    for stage in (first, middle, last):
        for name, p in stage.named_parameters():
            assert torch.equal(p, names[name]), name
    assert {n for s in (first, middle, last) for n, _ in s.named_parameters()} == set(names)
    # the tied head: a parameter of its own on a last stage without the embedding
    assert last.head.weight is not names["tok.weight"]
    with torch.no_grad():
        assert torch.allclose(last(middle(first(ids))), whole(ids))
