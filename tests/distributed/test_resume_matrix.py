"""A resume is the uninterrupted run: the resume matrix (tests/support/ranks/resume_matrix.py)
over strategy × layout (DDP, FSDP in both sync modes, HSDP, FSDP × TP, HSDP × TP, FSDP × PP,
ZeRO-1/2/3 ± offload) × optimizer (SGD, AdamW fused and not, Adam) × change (same size, shrink,
grow, tensor-parallel size), every pair of values covered: two windows, a checkpoint of every part,
two more windows, against the same two windows resumed from that checkpoint on the changed
layout. Weights and optimizer state equal (bit for bit on the same layout, ≤ 1e-6 relative
elsewhere); a tensor-parallel group's replicated parameters stay equal on its ranks."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from tests.support.ranks import resume_matrix as R
from tests.support.ranks.engine_helpers import spawn_ranks

pytestmark = pytest.mark.distributed

BOUND = 1e-6
"""Relative difference of the weights and of each optimizer slot (a layout's other reduction
order rounds otherwise, ~1e-8 here)."""

CASES = R.cases()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("resume_matrix")
    done: dict[str, dict[int, list[dict]]] = {"1": {}, "2": {}}
    for phase, world, chosen in R.phase_groups(CASES):
        folder = root / f"{phase}-{world}"
        folder.mkdir()
        target = functools.partial(R.run_group, phase=phase, chosen=chosen)
        # a group holds up to 35 cases (1 minute alone here): room for a loaded machine
        what = f"resume matrix phase {phase} on {world} ranks"
        ranks = spawn_ranks(target, world, folder, what, deadline_s=600)
        for r in ranks:
            assert "error" not in r, r.get("error")
        for case in chosen:
            done[phase][case.index] = [r[case.index] for r in ranks]
    return done


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(b.norm(), 1e-30))


def _determined(name: str, value: torch.Tensor) -> torch.Tensor:
    """`value` less what rounding alone decides: the key's bias of each attention (the
    middle third of the fused q, k, v bias). Softmax does not see a bias added to every key,
    so its gradient is rounding noise, which AdamW's normalisation turns into whole-LR steps
    of either sign (DeepSpeed's notes saw the same in plain DDP): its value after a step
    depends on the reduction order of the layout, not on the resume."""
    if name.endswith("attn.qkv.bias") or ".attn.qkv.bias." in name:
        third = value.numel() // 3
        return torch.cat([value[:third], value[2 * third :]])
    return value


def _vector(named: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([_determined(n, v) for n, v in sorted(named.items())])


def test_the_cases_cover_every_pair_of_values_that_runs():
    names = ("layout", "optimizer", "change")
    space = [
        dict(zip(names, combo, strict=True))
        for combo in itertools.product(R.LAYOUTS, R.OPTIMIZERS, R.CHANGES)
        if R.valid(*combo)
    ]
    for a, b in itertools.combinations(names, 2):
        pairs = {(x[a], x[b]) for x in space}
        covered = {(getattr(c, a), getattr(c, b)) for c in CASES}
        assert pairs <= covered, (a, b, pairs - covered)
    # every layout runs with dropout on its own ranks, every optimizer too
    assert {c.layout for c in CASES if c.dropout} == set(R.LAYOUTS)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label())
def test_a_resumed_run_is_the_uninterrupted_run(results, case, record_equivalence):
    straight, resumed = results["1"][case.index][0], results["2"][case.index][0]
    if case.compared:
        err = _rel(_vector(resumed["weights"]), _vector(straight["weights"]))
        record_equivalence(f"resume matrix #{case.index}: {case.label()}", err)
        if case.bitwise:
            for name, value in straight["weights"].items():
                assert torch.equal(resumed["weights"][name], value), (case.label(), name)
        assert err <= BOUND, (case.label(), err)
        if straight["optimizer"] is not None:
            assert resumed["optimizer"].keys() == straight["optimizer"].keys()
            for key, value in straight["optimizer"].items():
                got = resumed["optimizer"][key]
                assert got.shape == value.shape, (case.label(), key)
                if case.bitwise:
                    assert torch.equal(got, value), (case.label(), key)
                err = _rel(_determined(key, got), _determined(key, value))
                assert err <= BOUND, (case.label(), key, err)
    # every rank of a tensor-parallel group holds the same replicated parameters
    mesh = case.then
    if mesh.tp > 1:
        ranks = results["2"][case.index]
        for g in range(0, mesh.workers, mesh.tp):
            group = ranks[g : g + mesh.tp]
            for name, value in group[0]["replicated"].items():
                for other in group[1:]:
                    assert torch.equal(other["replicated"][name], value), (case.label(), name)
