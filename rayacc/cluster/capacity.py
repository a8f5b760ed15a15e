"""What Ray Train's elastic sizing counts, told when it changes.

An elastic group starts (and restarts) at the size Ray's autoscaling coordinator reserves for
it: Ray Train's elastic policy asks that detached actor, which reads the cluster's nodes every
20 s and counts every node that is alive — a node being drained for preemption included. So
after a reclaim the next group was first placed at the old size (the draining node takes no
new worker), waited out its start timeout there and only then went smaller; after a node was
lost without notice the same, until the coordinator's next look.

More: docs/design.md, "Notes from the code" (cluster/capacity.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["NodeWatch", "count_out", "drain", "draining_nodes", "live_nodes", "recount"]

TIMEOUT_S = 10.0
REQUESTER = "rayacc"
"""The name the coordinator's recount is asked under (it reserves nothing for it)."""


COORDINATOR = ("AutoscalingCoordinator", "AutoscalingCoordinator")
"""The coordinator actor's name and namespace (Ray's)."""


def _coordinator(create: bool = True):
    """The coordinator actor; `create`: made if there is none. Ray makes it pinned (hard) to
    the node of whoever asks first, for good (it is detached, restarted in place): only the
    driver creates it, on its node, never a rank on a node that may be reclaimed. None where
    there is none and `create` is off."""
    if not create:
        import ray

        try:
            return ray.get_actor(COORDINATOR[0], namespace=COORDINATOR[1])
        except ValueError:
            return None
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    return get_or_create_autoscaling_coordinator()


def drain(gcs, node_id: str, message: str, deadline: float) -> None:
    """Drains a node for preemption until `deadline` (time.time(), an instant) through a GCS
    client, as `ray drain-node` does; Ray keeps the newest request of a node. A refusal is an
    error naming the node."""
    from ray.core.generated import autoscaler_pb2

    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    accepted, why = gcs.drain_node(node_id, reason, message, int(deadline * 1000))
    if not accepted:
        raise RuntimeError(f"Ray refused the drain of node {node_id}: {why}")


def recount() -> None:
    """Has the coordinator read the cluster's nodes now (rather than at its next look)."""
    import ray

    coordinator = _coordinator()
    ray.get(coordinator.get_reserved_resources.remote(REQUESTER, recompute=True), timeout=TIMEOUT_S)


def count_out(nodes: Sequence[str], create: bool = True) -> bool:
    """Has the coordinator count `nodes` (hex ids) out while they are drained, from now on,
    and read the cluster at once. A drain that is cancelled counts the node in again. Said
    again, it is said again inside the coordinator (a restarted coordinator has forgotten).
    `create`: make the coordinator where there is none (the driver only); returns whether
    one was told."""
    import ray

    coordinator = _coordinator(create)
    if coordinator is None:
        return False  # nothing sizes an elastic group on this cluster

    def install(coordinator, leaving: tuple[str, ...], requester: str) -> None:
        # runs inside the coordinator: its own node listing, filtered (pickled by value, so
        # the coordinator's process imports nothing of rayacc)
        import ray as ray_in_actor

        held = getattr(coordinator, "_rayacc_leaving", None)
        if held is None:
            held = coordinator._rayacc_leaving = set()
            listed = coordinator._get_cluster_nodes

            def in_service():
                draining = ray_in_actor._private.state.state.get_draining_nodes()
                gone = held.intersection(draining)
                return [n for n in listed() if n["NodeID"] not in gone]

            coordinator._get_cluster_nodes = in_service
        held.update(leaving)
        coordinator.get_reserved_resources(requester, recompute=True)

    call = coordinator.__ray_call__.remote(install, tuple(nodes), REQUESTER)
    ray.get(call, timeout=TIMEOUT_S)
    return True


def live_nodes() -> frozenset[str]:
    """The ids of the cluster's live nodes."""
    import ray

    return frozenset(n["NodeID"] for n in ray.nodes() if n.get("Alive"))


def draining_nodes() -> dict[str, int]:
    """Nodes being drained → their deadline (epoch ms; 0: none), as Ray Train's watcher reads
    them."""
    import ray

    return ray._private.state.state.get_draining_nodes()


LEAD_S = 3.0
"""A drained node whose group nobody ends early is counted out this long before its deadline:
Ray Train's controller ends the group at the deadline and sizes the next one at once, so
counting out at the deadline raced it (and lost: the old size was tried first). Where the
ranks handle the notice, rank 0 counts the node out itself once its last checkpoint is
written, and the watch only at the deadline (their last windows run until just before it)."""
KNOWN_S = 6.0
"""... but not before the drain has been seen this long: by then Ray Train's watcher (it polls
every 5 s) has told the controller, which makes no resize decision for a group being
preempted; counted out earlier, the running group could be resized under the ranks."""


class NodeWatch:
    """The driver's look at the cluster for an elastic run, `poll()`ed as the run's items are
    relayed, at most once per `every_s`: a drained node whose deadline is `lead_s` away (the
    drain known for `KNOWN_S`) or past is counted out — the group there ends by then, whoever
    ends it: rank 0 after its last checkpoint, or Ray Train at the deadline; otherwise, when
    the live nodes changed since the last look (a node lost without notice, one that joined),
    the coordinator recounts. A failure to tell it is handed to `warn` once; after one of Ray's
    errors (the coordinator restarting) the next look tries again, after any other the watch
    stops."""

    def __init__(
        self,
        warn: Callable[[str], None],
        every_s: float = 1.0,
        lead_s: float = LEAD_S,
        nodes: Callable[[], frozenset[str]] = live_nodes,
        draining: Callable[[], dict[str, int]] = draining_nodes,
        tell: Callable[[], None] = recount,
        leave: Callable[[Sequence[str]], None] = count_out,
        clock: Callable[[], float] | None = None,
        wall: Callable[[], float] | None = None,
    ):
        import time

        self.warn, self.every_s, self.nodes, self.draining = warn, every_s, nodes, draining
        self.tell, self.leave, self.lead_s = tell, leave, lead_s
        self.clock = clock or time.monotonic
        self.wall = wall or time.time
        self.seen: frozenset[str] | None = None
        self.counted_out: set[str] = set()
        self.drains_seen: dict[str, float] = {}
        """Drained node → when this watch first saw the drain (its clock)."""
        self.next_at = float("-inf")
        self.draining_now: dict[str, int] = {}
        self.recounts = 0
        self.stopped = False
        self.warned = False

    def poll(self) -> None:
        now = self.clock()
        if self.stopped or now < self.next_at:
            return
        self.next_at = now + self.every_s
        try:
            nodes = self.nodes()
            wall = self.wall()
            due = set()
            self.draining_now = self.draining()
            for node, deadline_ms in self.draining_now.items():
                seen = self.drains_seen.setdefault(node, now)
                left_s = deadline_ms / 1000 - wall
                near = deadline_ms > 0 and left_s <= self.lead_s
                if node in nodes and near and (left_s <= 0 or now - seen >= KNOWN_S):
                    due.add(node)
            # told again while they drain: a coordinator restarted meanwhile (it is Ray's
            # detached actor, restarted in place) has forgotten what it was told
            again = self.counted_out & set(self.draining_now)
            due -= self.counted_out
            if due or again:
                self.leave(sorted(due | again))
                self.counted_out |= due
                self.recounts += bool(due)
            elif self.seen is not None and nodes != self.seen:
                self.tell()
                self.recounts += 1
            self.seen = nodes
        except Exception as exc:  # the coordinator's own look, every 20 s, remains
            # a coordinator being restarted (or slow to answer on a loaded head) is asked
            # again at the next look: what was not told is still due then
            passing = _passing(exc)
            self.stopped = not passing
            if not self.warned:
                self.warned = True
                again = "it is asked again at the next look" if passing else "the watch stops"
                self.warn(
                    "could not have Ray's autoscaling coordinator recount the cluster's nodes "
                    f"({type(exc).__name__}: {exc}); {again}, and a lost node may be counted "
                    "until the coordinator's own next look"
                )


def _passing(exc: BaseException) -> bool:
    """Whether a failure to reach the coordinator may pass: Ray's own errors (an actor being
    restarted, a call timed out), not a missing API or a GCS that does not answer."""
    try:
        from ray.exceptions import RayError
    except ImportError:
        return False
    return isinstance(exc, RayError)
