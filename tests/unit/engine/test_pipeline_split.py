"""How a model is cut into pipeline stages: contiguous runs of its units balanced by
parameter count (the slowest stage sets the pace), each rank's stages under a loop and a V,
and the built-in GPT cut down to a stage keeping the whole model's names."""

from __future__ import annotations

import itertools

import pytest
import torch

from rayacc.config.mesh import Mesh
from rayacc.engine.parallel.pipeline import balanced_runs, stage_indices
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
    held = [Mesh(2, schedule=s, looped=3).stages_per_rank
            for s in ("gpipe", "1f1b", "interleaved_1f1b", "zbv")]  # fmt: skip
    assert held == [1, 1, 3, 2]
    # the schedule's idle share: (P − 1) / (v·m + P − 1)
    assert Mesh(4, schedule="1f1b").bubble(4) == 3 / 7
    assert Mesh(4, schedule="interleaved_1f1b", looped=2).bubble(4) == 3 / 11


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


LLAMA = {"model_type": "llama", "vocab_size": 16, "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 2,
         "max_position_embeddings": 8}  # fmt: skip


@pytest.mark.parametrize("tied", [False, True])
def test_a_stage_of_a_transformers_llama_keeps_the_whole_models_names_and_values(tied):
    """The `hf` wrapper's split: the embeddings, each decoder layer under its own index, the
    norm with the head; the stages' forwards in a row give the whole model's logits."""
    pytest.importorskip("transformers")
    from rayacc.models.hf import build_hf

    def build():
        torch.manual_seed(3)
        return build_hf({**LLAMA, "tie_word_embeddings": tied}, None, 16, 9)

    whole, ids = build(), torch.randint(0, 16, (2, 8))
    names = dict(whole.named_parameters(remove_duplicate=False))
    assert len(whole.pipeline_units()) == 5
    first, middle, last = (build().keep_pipeline_units(r) for r in (range(0, 2), range(2, 3),
                                                                      range(3, 5)))  # fmt: skip
    for stage in (first, middle, last):
        for name, p in stage.named_parameters():
            assert torch.equal(p, names[name]), name
    # every name once over the stages (a tied head under its own on the last)
    assert {n for s in (first, middle, last) for n, _ in s.named_parameters()} == set(names)
    assert set(dict(middle.named_parameters())) == {
        n for n in names if n.startswith("hf.model.layers.1.")}  # fmt: skip
    with torch.no_grad():
        assert torch.allclose(last(middle(first(ids))), whole(ids), atol=1e-6)
    assert whole.pipeline_tied() == ({"hf.lm_head.weight": "hf.model.embed_tokens.weight"}
                                     if tied else {})  # fmt: skip


def test_an_architecture_rayacc_does_not_split_is_named():
    pytest.importorskip("transformers")
    from rayacc.config.mesh import Mesh
    from rayacc.models import ModelError
    from rayacc.models.hf import build_hf
    from rayacc.models.registry import check_pipeline_split

    gpt2 = build_hf({"model_type": "gpt2", "vocab_size": 16, "n_embd": 16, "n_layer": 2,
                     "n_head": 2, "n_positions": 8}, None, 16, 9)  # fmt: skip
    with pytest.raises(ModelError, match="train.pipeline_parallel=2: model.hf: the 'gpt2'"):
        check_pipeline_split(gpt2, Mesh(2))
    llama = build_hf(LLAMA, None, 16, 9)
    with pytest.raises(ModelError, match="6 stages take a unit each of the model's 5"):
        check_pipeline_split(llama, Mesh(3, schedule="zbv"))
    check_pipeline_split(llama, Mesh(2))  # 5 units for 2 stages
