"""`python -m rayacc.cluster.spot`: a cloud's reclaim warning, read from a metadata server that
speaks the AWS (IMDSv2) or GCP protocol on loopback, becomes one drain of this Ray node with the
seconds the cloud gave."""

from __future__ import annotations

import datetime as dt
import http.server
import json
import threading
from typing import ClassVar

import pytest

from rayacc.cluster.spot import GCP_NOTICE_S, aws_notice, gcp_notice, watch


class Metadata(http.server.BaseHTTPRequestHandler):
    """AWS: a token first, then 404 until `state["reclaim_at"]`; GCP: FALSE, then TRUE."""

    state: ClassVar[dict] = {}

    def log_message(self, *args):  # quiet
        pass

    def do_PUT(self):
        assert self.path == "/latest/api/token"
        assert self.headers["X-aws-ec2-metadata-token-ttl-seconds"]
        self._send(200, b"tok")

    def do_GET(self):
        script = self.state.get("script") or []
        if script:  # replies of a server in trouble, served first
            code, body = script.pop(0)
            return self._send(code, body)
        self.state["polls"] = self.state.get("polls", 0) + 1
        announced = self.state["polls"] > self.state["quiet_polls"]
        if self.path == "/latest/meta-data/spot/instance-action":
            assert self.headers["X-aws-ec2-metadata-token"] == "tok"
            if not announced:
                return self._send(404, b"")
            body = {"action": "terminate", "time": self.state["reclaim_at"]}
            return self._send(200, json.dumps(body).encode())
        if self.path == "/computeMetadata/v1/instance/preempted":
            assert self.headers["Metadata-Flavor"] == "Google"
            return self._send(200, b"TRUE" if announced else b"FALSE")
        self._send(404, b"")

    def _send(self, code, body):
        self.send_response(code)
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def metadata():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    Metadata.state = {"quiet_polls": 3}
    yield f"http://127.0.0.1:{server.server_address[1]}", Metadata.state
    server.shutdown()


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
