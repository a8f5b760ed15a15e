"""A cloud's instance metadata server on loopback, speaking the AWS (IMDSv2) and GCP protocols
for `rayacc.cluster.spot`: no reclaim for `quiet_polls` polls (or until `announced` is set),
then the reclaim warning."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from typing import ClassVar


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
        announced = self.state.get("announced") or (
            self.state["polls"] > self.state.get("quiet_polls", float("inf"))
        )
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


@contextlib.contextmanager
def serve(state: dict):
    """A metadata server on loopback with `state` (Metadata's); (its URL, the state)."""
    Metadata.state = state
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", Metadata.state
    finally:
        server.shutdown()
