"""An elastic group's first size on a cluster rayacc joined: Ray's autoscaling coordinator (a
detached actor that outlives runs) decides it from the nodes it read at its last look, every
20 s. A node that joined since was missed: the group started at 1 worker, grew at its first
resize check and redid the steps before it (a multi-node run that flapped so). The driver has
the coordinator read the nodes before the group is asked for.

Here the coordinator's view is emptied by hand, which is what it holds of a node it has not
looked at yet, and the driver must bring it back."""

from __future__ import annotations

import time

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
        refresh_elastic_sizing(cfg.scaling)
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


def test_the_count_out_is_told_again_after_the_coordinator_restarts_and_no_rank_creates_it(
    ray_local,
):
    """Ray restarts its detached coordinator in place (max_restarts=-1), forgetting what it
    was told: the driver's watch tells it again at its next look while the node drains. A rank
    (which may sit on the node that goes: Ray pins the actor, for good, to whoever asks first)
    never creates it; the driver does, on its own node."""
    import ray

    from rayacc.cluster.capacity import COORDINATOR, NodeWatch, count_out, live_nodes

    def leaving(actor):
        return ray.get(
            actor.__ray_call__.remote(lambda self: sorted(getattr(self, "_rayacc_leaving", ())))
        )

    ray.kill(coordinator(), no_restart=True)
    with pytest.raises(ValueError):
        ray.get_actor(COORDINATOR[0], namespace=COORDINATOR[1])
    (head,) = live_nodes()
    assert count_out([head], create=False) is False  # a rank's call: nothing made
    with pytest.raises(ValueError):
        ray.get_actor(COORDINATOR[0], namespace=COORDINATOR[1])

    drains = {head: int((time.time() + 1.0) * 1000)}
    warned: list[str] = []
    watch = NodeWatch(warned.append, every_s=0.0, lead_s=5.0, draining=lambda: drains)
    watch.drains_seen[head] = float("-inf")  # known long enough
    watch.poll()
    actor = ray.get_actor(COORDINATOR[0], namespace=COORDINATOR[1])
    assert leaving(actor) == [head]
    where = ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))
    assert where == ray.get_runtime_context().get_node_id(), "made on the driver's node"
    ray.kill(actor, no_restart=False)  # Ray restarts it: what it was told is gone
    deadline = time.monotonic() + 30
    while True:
        try:
            if leaving(actor) == []:
                break
        except ray.exceptions.RayActorError:
            pass
        assert time.monotonic() < deadline, "the coordinator did not restart"
    # the driver looks about once a second while it relays; a coordinator still coming up
    # (slow on a loaded head) is asked again at the next look
    while True:
        watch.poll()
        if leaving(actor) == [head]:
            break
        assert not watch.stopped and time.monotonic() < deadline + 30, warned
        time.sleep(0.5)
    drains.clear()
    forget_the_nodes(actor)
    ray.get(actor.get_reserved_resources.remote("tests", recompute=True))
    assert nodes_seen(actor) == sum(node["Alive"] for node in ray.nodes())
