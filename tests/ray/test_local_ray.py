"""What `rayacc` does on the local Ray it starts itself."""

from __future__ import annotations

from tests.support import ROOT
from tests.support.services.cli import rayacc_process


def test_the_elastic_job_on_a_local_ray_exits_2_instead_of_waiting(tmp_path):
    proc = rayacc_process(
        ["train", "-c", str(ROOT / "jobs/elastic_digits.yaml")],
        cwd=tmp_path,
        timeout=180,
        RAY_ADDRESS="",
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "worker_slot" in proc.stderr and "Fix:" in proc.stderr
    assert "Traceback" not in proc.stderr
