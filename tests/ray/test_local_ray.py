"""What `rayacc` does on the local Ray it starts itself."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support import ROOT


def test_the_elastic_job_on_a_local_ray_exits_2_instead_of_waiting(tmp_path):
    env = dict(os.environ, RAY_ADDRESS="")
    proc = subprocess.run(
        [sys.executable, "-m", "rayacc.cli", "train", "-c", str(ROOT / "jobs/elastic_digits.yaml")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "worker_slot" in proc.stderr and "Fix:" in proc.stderr
    assert "Traceback" not in proc.stderr
