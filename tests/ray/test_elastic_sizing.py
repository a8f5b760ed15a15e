"""An elastic group's first size on a cluster rayacc joined: Ray's autoscaling coordinator (a
detached actor that outlives runs) decides it from the nodes it read at its last look, every
20 s. A node that joined since was missed: the group started at 1 worker, grew at its first
resize check and redid the steps before it (a multi-node run that flapped so). The driver has
the coordinator read the nodes before the group is asked for.

Here the coordinator's view is emptied by hand, which is what it holds of a node it has not
looked at yet, and the driver must bring it back."""

from __future__ import annotations

import pytest

from rayacc.driver.fit import refresh_elastic_sizing
from tests.support.services.fits import config

pytestmark = pytest.mark.ray


def coordinator():
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    return get_or_create_autoscaling_coordinator()


def nodes_seen(actor) -> int:
    import ray

    return ray.get(
        actor.__ray_call__.remote(
            lambda self: sum(len(nodes) for nodes in self._cluster_node_resources.values())
        )
    )


def forget_the_nodes(actor) -> None:
    import ray

    ray.get(actor.__ray_call__.remote(lambda self: setattr(self, "_cluster_node_resources", {})))


@pytest.mark.parametrize(
    ("num_workers", "joined", "looks"),
    [
        ([1, 2], True, True),  # an elastic run on a joined cluster
        (2, True, False),  # a fixed size: Ray Train places it without the coordinator
        ([1, 2], False, False),  # a local Ray rayacc starts has every node from the start
    ],
)
def test_the_coordinator_reads_the_nodes_before_an_elastic_group_starts(
    ray_local, ray_address, tmp_path, monkeypatch, num_workers, joined, looks
):
    import ray

    actor = coordinator()
    alive = sum(node["Alive"] for node in ray.nodes())
    assert nodes_seen(actor) == alive
    if joined:
        monkeypatch.setenv("RAY_ADDRESS", ray_address)
    else:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cfg = config(tmp_path, scaling={"num_workers": num_workers, "cpus_per_worker": 0.5})
    forget_the_nodes(actor)
    try:
        refresh_elastic_sizing(cfg)
        assert nodes_seen(actor) == (alive if looks else 0)
    finally:
        ray.get(actor.get_reserved_resources.remote("tests", recompute=True))
    assert nodes_seen(actor) == alive


def test_a_node_counted_out_is_counted_while_no_drain_of_it_is_in_effect(ray_local):
    """`count_out` runs its listing inside Ray's coordinator (its process imports nothing of
    rayacc): the filter is installed there, and a node that is not being drained (a drain
    cancelled) stays counted. The drained case is the multi-node spot test's."""
    import ray

    from rayacc.cluster.capacity import count_out, live_nodes

    actor = coordinator()
    alive = sum(node["Alive"] for node in ray.nodes())
    (head,) = live_nodes()
    count_out([head])
    assert ray.get(actor.__ray_call__.remote(lambda self: sorted(self._rayacc_leaving))) == [head]
    forget_the_nodes(actor)
    ray.get(actor.get_reserved_resources.remote("tests", recompute=True))
    assert nodes_seen(actor) == alive
