"""FSDP's mesh from the group's placement (`fsdp.replicate`): one replica group per node where
the nodes hold equal numbers of ranks, never a mesh that does not cover the group."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rayacc.engine.parallel.fsdp_mesh import MeshShape, groups_across_nodes, mesh_shape


@pytest.mark.parametrize(
    ("replicate", "nodes", "shape"),
    [
        ("auto", ["a", "a", "b", "b"], (2, 2)),
        ("auto", ["a", "b", "a", "b"], (2, 2)),
        ("auto", ["a", "a", "a", "a"], (1, 4)),
        ("auto", ["a", "a", "b"], (1, 3)),
        ("auto", ["a", "b", "c"], (3, 1)),
        (2, ["a", "a", "a", "a"], (2, 2)),
        (1, ["a", "a", "b", "b"], (1, 4)),
        (4, ["a", "a", "b", "b"], (4, 1)),
    ],
)
def test_the_mesh_of_a_placement(replicate, nodes, shape):
    got = mesh_shape(replicate, nodes)
    assert (got.replicate, got.shard) == shape


def test_auto_says_why_it_chose():
    assert mesh_shape("auto", ["a", "a", "b", "b"]).why == "2 nodes"
    assert "unequal" in mesh_shape("auto", ["a", "a", "b"]).why
    assert str(MeshShape(2, 4)) == "2 × 4"


def test_a_number_that_does_not_divide_the_group_is_refused():
    with pytest.raises(ValueError, match="does not divide the group's 4 workers"):
        mesh_shape(3, ["a"] * 4)


@given(st.lists(st.sampled_from("abcd"), min_size=1, max_size=16))
def test_auto_covers_the_group_and_keeps_shard_groups_inside_nodes(nodes):
    got = mesh_shape("auto", nodes)
    assert got.replicate * got.shard == len(nodes)
    counts = {nodes.count(n) for n in set(nodes)}
    if got.replicate > 1:
        # every node holds exactly one shard group
        assert got.replicate == len(set(nodes)) and counts == {got.shard}


@pytest.mark.parametrize(
    ("nodes", "size", "across"),
    [
        (["a", "a", "b", "b"], 2, 0),
        (["a", "b", "a", "b"], 2, 0),  # ranks ordered node by node first
        (["a", "a", "a", "b", "b", "b"], 2, 1),  # 3 a node: the middle group spans both
        (["a", "a", "a", "b", "b", "b"], 3, 0),
        (["a", "b", "c", "d"], 2, 2),
        (["a", "a", "a", "a"], 4, 0),
    ],
)
def test_the_tensor_parallel_groups_a_placement_puts_across_nodes(nodes, size, across):
    assert groups_across_nodes(nodes, size) == across


def test_the_mesh_line_says_a_group_across_nodes():
    from rayacc.engine.parallel import FSDP

    strategy = FSDP(tensor_parallel=2)
    strategy.mesh, strategy._tp_across = MeshShape(1, 3), 1
    assert strategy.describe_mesh() == (
        "FSDP × TP mesh 3 × 2 (dp × tp); 1 tensor-parallel group(s) across nodes: their "
        "per-layer collectives run over the links between them"
    )
    strategy._tp_across = 0
    assert strategy.describe_mesh() == "FSDP × TP mesh 3 × 2 (dp × tp)"
