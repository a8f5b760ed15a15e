"""The reclaim warning of a spot VM, passed on to Ray: `python -m rayacc.cluster.spot --cloud
aws|gcp` runs beside `ray start` on each spot worker node (cluster/aws.yaml,
cluster/gcp.yaml) and polls the instance metadata; when the cloud announces the reclaim it
drains this Ray node for preemption with the deadline the cloud gave (what `ray drain-node
--reason DRAIN_NODE_REASON_PREEMPTION` does, the deadline an instant), which is what Ray Train's
preemption watcher — and so rayacc's just-in-time checkpoint — reacts to.

- AWS: `spot/instance-action` (IMDSv2) answers 404 until the two-minute warning, then the time
  the instance goes.
- GCP: `instance/preempted` turns TRUE when a spot VM is preempted; the VM has 30 s from then.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import stat
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "GCP_NOTICE_S",
    "STATE",
    "aws_notice",
    "default_state",
    "drain_this_node",
    "gcp_notice",
    "watch",
]

GCP_NOTICE_S = 30
"""Compute Engine stops a preempted spot VM about 30 s after the notice."""
AWS_METADATA = "http://169.254.169.254"
GCP_METADATA = "http://metadata.google.internal"


def aws_notice(base: str = AWS_METADATA, now: Callable[[], float] = time.time) -> float | None:
    """Seconds until AWS reclaims this instance, or None while no reclaim is announced."""
    token_request = urllib.request.Request(
        f"{base}/latest/api/token",
        method="PUT",
        headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"},
    )
    with urllib.request.urlopen(token_request, timeout=2) as r:
        token = r.read().decode()
    request = urllib.request.Request(
        f"{base}/latest/meta-data/spot/instance-action",
        headers={"X-aws-ec2-metadata-token": token},
    )
    try:
        with urllib.request.urlopen(request, timeout=2) as r:
            action = json.loads(r.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise
    when = dt.datetime.strptime(action["time"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
    return max(0.0, when.timestamp() - now())


def gcp_notice(base: str = GCP_METADATA) -> float | None:
    """GCP_NOTICE_S once Compute Engine has preempted this VM, else None."""
    request = urllib.request.Request(
        f"{base}/computeMetadata/v1/instance/preempted",
        headers={"Metadata-Flavor": "Google"},
    )
    with urllib.request.urlopen(request, timeout=2) as r:
        return float(GCP_NOTICE_S) if r.read().decode().strip().upper() == "TRUE" else None


def drain_this_node(seconds: float, node_id: str | None = None, address: str | None = None) -> None:
    """Drains this machine's Ray node (or `node_id`) for preemption, with its deadline
    `seconds` from this call: the deadline is fixed before Ray is imported and the cluster
    reached (`ray drain-node` counted its `--deadline-remaining-seconds` from after its own
    start, seconds later on a loaded machine: the drain's deadline fell after the provider's,
    and the run planned its last checkpoint for a node already gone)."""
    deadline = time.time() + max(seconds, 0.0)
    import ray
    from ray._private import services

    from rayacc.cluster.capacity import drain

    # as `ray drain-node` finds the cluster and the node (Ray 2.60)
    address = services.canonicalize_bootstrap_address_or_die(address)
    if node_id is None:
        node_id = ray.get_runtime_context().get_node_id()
    drain(ray._raylet.GcsClient(address=address), node_id, "spot reclaim", deadline)


def default_state() -> Path:
    """Where the agent records the notice it handled: the specs restart it every few seconds
    while it runs (and whenever it exits), and each new drain would replace the deadline the
    run set since (rayacc's early end of the group: `worker/preemption.py::end_group_now`). A
    folder of its own that only its user writes: root's under /run (gone at a reboot), another
    user's in its home."""
    if os.geteuid() == 0:
        return Path("/run/rayacc-spot/state.json")
    return Path.home() / ".cache" / "rayacc" / "spot" / "state.json"


STATE = str(default_state())
STALE_S = 600.0
"""A recorded notice older than its deadline by this much is not this VM's."""
MAX_NOTICE_S = 150.0
"""The longest notice a cloud gives (AWS: two minutes), with a margin: a recorded deadline
further from this notice's is another notice's (or nobody's), and ignored."""
SLACK_S = 5.0
"""A recorded deadline may be this much later than this notice's (clocks, rounding)."""
_MAX_STATE_BYTES = 4096


def _own_folder(folder: Path, log: Callable[[str], None]) -> bool:
    """Whether `folder` is one only this user writes (made so where missing): a folder, not
    a link, owned by this user, writable by nobody else. Said where it is not."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(folder)
    except OSError as exc:
        log(f"rayacc.cluster.spot: cannot keep its state in {folder} ({exc}); going without it")
        return False
    if (
        not stat.S_ISDIR(st.st_mode)
        or st.st_uid != os.geteuid()
        or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    ):
        log(
            f"rayacc.cluster.spot: {folder} is not a folder only this user writes (a link, "
            "another owner, or writable by others): its state is not kept there; every notice "
            "is drained as new. Fix: give --state a file in a folder of its own"
        )
        return False
    return True


def _recorded(state: Path | None, log: Callable[[str], None] = lambda _: None) -> dict:
    """The record the agent wrote, or {}: read without following a link, and only a regular
    file of this user's, small, of the agent's shape (anything else is said and ignored)."""
    if state is None:
        return {}
    try:
        fd = os.open(state, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        log(f"rayacc.cluster.spot: {state} is not read ({exc}): ignored")
        return {}
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            log(f"rayacc.cluster.spot: {state} is not this agent's record (owner, kind): ignored")
            return {}
        data = f.read(_MAX_STATE_BYTES + 1)
    try:
        doc = json.loads(data) if len(data) <= _MAX_STATE_BYTES else None
    except (ValueError, RecursionError):
        doc = None
    deadline = doc.get("deadline") if isinstance(doc, dict) else None
    if (
        not isinstance(deadline, int | float)
        or isinstance(deadline, bool)
        or not math.isfinite(deadline)
        or not isinstance(doc.get("drained"), bool)
    ):
        log(f"rayacc.cluster.spot: {state} is not a record the agent writes: ignored")
        return {}
    return doc


def _record(state: Path | None, **fields) -> None:
    if state is None:
        return
    # a name of its own in a folder only this user writes, never through a link
    partial = state.with_name(f"{state.name}.{os.getpid()}.partial")
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(fields))
        os.replace(partial, state)
    except OSError as exc:  # the drain matters, not its record
        print(f"rayacc.cluster.spot: could not record {state} ({exc})", file=sys.stderr)


def watch(
    notice: Callable[[], float | None],
    drain: Callable[[float], None] = drain_this_node,
    interval_s: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    state: Path | None = None,
    now: Callable[[], float] = time.time,
) -> float:
    """Polls `notice` until it announces a reclaim, drains this node once with the seconds
    left, and returns them. Nothing one poll or one drain does ends the watch: a poll that
    fails (a server away, an error reply, a reply of another shape) is said and retried after a
    back-off of at most 4 intervals (a 30 s notice still leaves most of it); a drain that fails
    is said and retried with the seconds then left, until it succeeds or the time is up.

    `state`: the notice is recorded there when first seen (its deadline) and once drained.
    An agent started again meanwhile never drains later than the deadline first seen (GCP's
    notice says "30 s" to whoever asks, whenever), and one started after the drain stays out of
    the way until the deadline is long past: one drain per notice."""
    failures = 0
    said: set[str] = set()
    while True:
        try:
            left = notice()
        except Exception as exc:
            failures += 1
            kind = type(exc).__name__
            if kind not in said:  # each kind of failure said once, not every 2 s
                log(f"rayacc.cluster.spot: metadata poll failed ({kind}: {exc}); retrying")
                said.add(kind)
            sleep(interval_s * min(2 ** (failures - 1), 4))
            continue
        failures = 0
        if left is None:
            sleep(interval_s)
            continue
        t = now()
        if state is not None and "state" not in said:
            said.add("state")
            if not _own_folder(state.parent, log):
                state = None
        seen = _recorded(state, log)
        if seen and not t + left - MAX_NOTICE_S <= seen["deadline"] <= t + left + SLACK_S:
            # not this notice's: a real notice always drains
            log(
                f"rayacc.cluster.spot: the record in {state} names a deadline "
                f"{seen['deadline'] - t:+.0f} s from now, this notice {left:+.0f} s: not this "
                "notice's, ignored"
            )
            seen = {}
        if seen and t < seen["deadline"] + STALE_S:
            # drained, or its deadline past (a drain now could only move it): this notice's
            # work is done
            if seen.get("drained") or t >= seen["deadline"]:
                if "handled" not in said:
                    log(
                        "rayacc.cluster.spot: this notice is handled (deadline "
                        f"{seen['deadline'] - t:+.0f} s): staying out of the way"
                    )
                    said.add("handled")
                sleep(interval_s)
                continue
            left = min(left, seen["deadline"] - t)  # never later than the deadline first seen
        else:
            _record(state, deadline=t + left, drained=False)
        log(f"rayacc.cluster.spot: reclaim announced, {left:.0f} s left: draining this Ray node")
        deadline = time.monotonic() + left
        wall_deadline = t + left
        while True:
            try:
                drain(left)
                _record(state, deadline=wall_deadline, drained=True)
                return left
            except Exception as exc:
                left = deadline - time.monotonic()
                log(
                    f"rayacc.cluster.spot: drain failed ({type(exc).__name__}: {exc}); "
                    f"{max(left, 0):.0f} s left"
                )
                if left <= 1:
                    return 0.0
                sleep(min(interval_s, left / 4))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rayacc.cluster.spot", description=__doc__)
    parser.add_argument("--cloud", choices=("aws", "gcp"), required=True)
    parser.add_argument("--interval-s", type=float, default=2.0)
    parser.add_argument("--metadata-url", default=None, help="the metadata server (tests)")
    parser.add_argument(
        "--state",
        default=STATE,
        help="where the notice handled is recorded (one drain each), in a folder only this "
        "user writes",
    )
    parser.add_argument("--node-id", default=None, help="the Ray node (default: this machine's)")
    parser.add_argument("--address", default=None, help="the Ray cluster (default: this one's)")
    args = parser.parse_args(argv)
    if args.cloud == "aws":
        base = args.metadata_url or AWS_METADATA
        notice = lambda: aws_notice(base)  # noqa: E731
    else:
        base = args.metadata_url or GCP_METADATA
        notice = lambda: gcp_notice(base)  # noqa: E731

    def drain(seconds: float) -> None:
        drain_this_node(seconds, args.node_id, args.address)

    state = Path(args.state)
    while True:
        # after the drain the agent stays: one started again (the specs restart it) reads the
        # record and leaves the node's deadline as it is
        watch(notice, drain=drain, interval_s=args.interval_s, state=state)


if __name__ == "__main__":
    sys.exit(main())
