"""A spot reclaim as a cloud makes it, on a loopback cluster (cluster/local.sh): the tests'
and bench/spot_goodput.py's."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.services.cluster import local
from tests.support.services.metadata import serve


def reclaim_with_the_agent(
    cluster: dict, node: int, folder: Path, log: Path, notice_s: float
) -> None:
    """A reclaim as a cloud makes it: the instance metadata announces it (AWS's protocol,
    `notice_s` ahead), the spot agent runs as the cluster specs run it (a shell loop that starts
    it again whenever it exits) and is killed every 3 s besides (never in the middle of its
    drain), then the node goes at the deadline."""
    addresses = dict(
        line.removeprefix("export ").split("=", 1)
        for line in Path(cluster["RAYACC_CLUSTER_ENV"]).read_text().splitlines()
        if line.strip()
    )
    node_id = local("node-id", str(node), env=cluster).stdout.strip()
    assert node_id, f"worker node {node} is not in the cluster"
    record = folder / "spot.json"
    reclaim_at = dt.datetime.fromtimestamp(time.time() + notice_s, dt.UTC)
    with serve({"announced": True, "reclaim_at": reclaim_at.strftime("%Y-%m-%dT%H:%M:%SZ")}) as (
        url,
        _,
    ):
        agent = (
            f"{sys.executable} -m rayacc.cluster.spot --cloud aws --metadata-url {url} "
            f"--node-id {node_id} --address {addresses['RAYACC_GCS_ADDRESS']} "
            f"--state {record} --interval-s 0.5"
        )
        loop = subprocess.Popen(
            ["sh", "-c", f"while true; do {agent}; sleep 1; done"],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            env=dict(cluster, RAY_AUTH_MODE="token"),
            start_new_session=True,
        )
        try:
            while dt.datetime.now(dt.UTC) < reclaim_at:
                time.sleep(3)
                state = json.loads(record.read_text()) if record.exists() else {}
                if not state or state.get("drained"):
                    # the agent, not the loop that starts it (its command line names it too)
                    agent_only = f"^{re.escape(sys.executable)} -m rayacc[.]cluster[.]spot .*{url}"
                    subprocess.run(["pkill", "-f", agent_only])
        finally:
            os.killpg(loop.pid, signal.SIGKILL)
            loop.wait()
    local("remove", str(node), env=cluster)
