"""`python -m rayacc.cluster.spot`: a cloud's reclaim warning, read from a metadata server that
speaks the AWS (IMDSv2) or GCP protocol on loopback, becomes one drain of this Ray node with the
seconds the cloud gave."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import pytest

from rayacc.cluster.spot import GCP_NOTICE_S, aws_notice, gcp_notice, watch
from tests.support.services.metadata import serve


@pytest.fixture
def metadata():
    with serve({"quiet_polls": 3}) as (url, state):
        yield url, state


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_a_reclaim_warning_drains_this_node_once_with_the_time_given(metadata, cloud):
    base, state = metadata
    now = 1_800_000_000.0
    state["reclaim_at"] = dt.datetime.fromtimestamp(now + 118, dt.UTC).strftime(
        "%Y-%m-%dT%H:%M:%SZ"
    )
    notice = (
        (lambda: aws_notice(base, now=lambda: now))
        if cloud == "aws"
        else (lambda: gcp_notice(base))
    )
    drained, slept = [], []
    left = watch(notice, drain=drained.append, sleep=slept.append, log=lambda line: None)
    expected = 118.0 if cloud == "aws" else float(GCP_NOTICE_S)
    assert drained == [expected] and left == expected
    assert len(slept) == 3  # quiet polls, then the notice


def test_an_unreachable_metadata_server_is_said_once_and_retried():
    calls, lines = [], []

    def notice():
        calls.append(1)
        if len(calls) < 4:
            raise OSError("connection refused")
        return 25.0

    drained = []
    assert watch(notice, drain=drained.append, sleep=lambda s: None, log=lines.append) == 25.0
    assert drained == [25.0]
    assert len([line for line in lines if "poll failed (OSError" in line]) == 1


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_the_agent_outlives_bad_replies_and_failed_drains_then_drains(metadata, cloud):
    """Errors and garbage from the metadata server, then a real notice; the first two drains
    fail (a `ray drain-node` that exits non-zero): the agent says each kind once, keeps
    watching, and drains with the seconds then left."""
    import subprocess

    base, state = metadata
    now = 1_800_000_000.0
    state["reclaim_at"] = dt.datetime.fromtimestamp(now + 118, dt.UTC).strftime(
        "%Y-%m-%dT%H:%M:%SZ"
    )
    state["quiet_polls"] = 1
    garbage = [(500, b"oops"), (200, b"<html>not json"), (200, b'{"action": "terminate"}')]
    state["script"] = list(garbage) if cloud == "aws" else [(500, b""), (200, b"\xff\xfe")]
    notice = (
        (lambda: aws_notice(base, now=lambda: now))
        if cloud == "aws"
        else (lambda: gcp_notice(base))
    )
    attempts, lines = [], []

    def drain(seconds):
        attempts.append(seconds)
        if len(attempts) < 3:
            raise subprocess.CalledProcessError(1, ["ray", "drain-node"])

    left = watch(notice, drain=drain, sleep=lambda s: None, log=lines.append)
    assert len(attempts) == 3 and left == attempts[-1] > 0
    assert sum("drain failed" in line for line in lines) == 2
    failed = [line for line in lines if "poll failed" in line]
    assert failed and len(failed) == len({line.split("(")[1].split(":")[0] for line in failed})


class Stop(BaseException):
    """Ends an agent that stays out of the way (it would watch on forever)."""


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_an_agent_started_again_drains_once_per_notice_never_later(metadata, cloud, tmp_path):
    """The specs restart the agent every few seconds: a restart before the drain drains with
    no more than the deadline first seen (GCP's notice says 30 s to whoever asks), and every
    restart after it leaves the node's deadline as it is (the run may have moved it closer)."""
    base, state = metadata
    clock = [1_800_000_000.0]
    state["reclaim_at"] = dt.datetime.fromtimestamp(clock[0] + 118, dt.UTC).strftime(
        "%Y-%m-%dT%H:%M:%SZ"
    )
    state["quiet_polls"] = 0
    notice = (
        (lambda: aws_notice(base, now=lambda: clock[0]))
        if cloud == "aws"
        else (lambda: gcp_notice(base))
    )
    record = tmp_path / "spot.json"
    first_left = 118.0 if cloud == "aws" else float(GCP_NOTICE_S)

    # the first agent sees the notice, records it, and dies before its drain succeeds
    def dies(seconds):
        raise Stop

    with pytest.raises(Stop):
        watch(notice, drain=dies, state=record, now=lambda: clock[0], log=lambda line: None)
    clock[0] += 10  # restarted 10 s later
    drained = []
    watch(notice, drain=drained.append, state=record, now=lambda: clock[0], log=lambda _: None)
    assert drained == [pytest.approx(first_left - 10)]

    # restarted again (many times) after the drain: no more drains
    lines = []

    def sleep(_):
        if len(lines) >= 1:
            raise Stop

    for _ in range(3):
        clock[0] += 5
        with pytest.raises(Stop):
            watch(notice, drain=drained.append, state=record, now=lambda: clock[0],
                  sleep=sleep, log=lines.append)  # fmt: skip
    assert len(drained) == 1 and all("staying out of the way" in line for line in lines)


def test_the_drains_deadline_is_fixed_when_the_agent_drains_not_after_rays_start(monkeypatch):
    """`ray drain-node` counted its seconds from after its own start (seconds on a loaded CI
    machine): the drain's deadline fell after the provider's, the node went before the run's
    last checkpoint. The deadline is the instant of the call, however slow reaching Ray is."""
    import time

    import ray
    from ray._private import services

    from rayacc.cluster.spot import drain_this_node

    asked = []

    class Gcs:
        def __init__(self, address):
            self.address = address

        def drain_node(self, node_id, reason, message, deadline_ms):
            asked.append((self.address, node_id, deadline_ms))
            return True, ""

    def slow(address):
        time.sleep(1.5)  # a loaded machine reaching the cluster
        return address

    monkeypatch.setattr(services, "canonicalize_bootstrap_address_or_die", slow)
    monkeypatch.setattr(ray._raylet, "GcsClient", Gcs)
    called = time.time()
    drain_this_node(30.0, "ab" * 28, "127.0.0.1:6379")
    ((address, node, deadline_ms),) = asked
    assert (address, node) == ("127.0.0.1:6379", "ab" * 28)
    assert called + 29.99 <= deadline_ms / 1000 < called + 30.5  # (milliseconds)


def test_a_refused_drain_is_an_error_the_agent_retries(monkeypatch):
    import ray
    from ray._private import services

    from rayacc.cluster.spot import drain_this_node

    class Refusing:
        def __init__(self, address):
            pass

        def drain_node(self, *args):
            return False, "the node is not alive"

    monkeypatch.setattr(services, "canonicalize_bootstrap_address_or_die", lambda a: a)
    monkeypatch.setattr(ray._raylet, "GcsClient", Refusing)
    with pytest.raises(RuntimeError, match="the node is not alive"):
        drain_this_node(30.0, "ab" * 28, "127.0.0.1:6379")


def _announced(state, clock):
    state["reclaim_at"] = dt.datetime.fromtimestamp(clock + 118, dt.UTC).strftime(
        "%Y-%m-%dT%H:%M:%SZ"
    )
    state["quiet_polls"] = 0


def _planted_ignoring(folder: Path, record: Path):
    """What a state the agent did not write looks like, by way of planting it: a far deadline
    marked drained (it would keep the agent from ever draining), garbage, another owner's."""
    far = json.dumps({"deadline": 1e18, "drained": True})
    yield "a far deadline", lambda: record.write_text(far)
    yield "garbage", lambda: record.write_bytes(b"\x00{not json")
    yield "a link", lambda: (record.unlink(missing_ok=True), record.symlink_to(folder / "x"))

    def other_owner():
        record.write_text(far)
        os.chown(record, 65534, 65534)

    yield "another owner", other_owner


def test_a_real_notice_always_drains_whatever_state_was_planted(metadata, tmp_path):
    """The agent trusts only a record it wrote, in a folder only its user writes: a planted
    record (a far deadline marked drained, garbage, a link, another owner's) or a folder others
    write is ignored with a warning, and the notice is drained."""
    base, state = metadata
    clock = 1_800_000_000.0
    _announced(state, clock)
    folder = tmp_path / "own"
    folder.mkdir(mode=0o700)
    (folder / "x").write_text(json.dumps({"deadline": 1e18, "drained": True}))
    record = folder / "state.json"
    for how, plant in _planted_ignoring(folder, record):
        record.unlink(missing_ok=True)
        plant()
        drained, lines = [], []
        watch(lambda: aws_notice(base, now=lambda: clock), drain=drained.append, state=record,
              now=lambda: clock, log=lines.append)  # fmt: skip
        assert drained == [pytest.approx(118.0)], (how, lines)
        assert any("ignored" in line or "not read" in line for line in lines), (how, lines)
        assert json.loads((folder / "x").read_text())["deadline"] == 1e18, "a link was followed"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "state.json").write_text(json.dumps({"deadline": 1e18, "drained": True}))
    drained, lines = [], []
    watch(lambda: aws_notice(base, now=lambda: clock), drain=drained.append,
          state=shared / "state.json", now=lambda: clock, log=lines.append)  # fmt: skip
    assert drained == [pytest.approx(118.0)], lines
    assert any("not a folder only this user writes" in line for line in lines), lines


def test_the_default_state_is_in_a_folder_of_its_own():
    from rayacc.cluster.spot import default_state

    where = default_state()
    assert where.parent.name == "spot" or where.parent == Path("/run/rayacc-spot")
    assert not str(where).startswith("/tmp")
