"""`rayacc submit` checks that run before anything is uploaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayacc.driver import jobs

ROOT = Path(__file__).resolve().parents[3]


def test_upload_honours_gitignore(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    before = jobs.upload_size(ROOT)
    ignored = ROOT / ".rayacc" / "test-upload-size.bin"  # .rayacc/ is in .gitignore
    ignored.parent.mkdir(exist_ok=True)
    ignored.write_bytes(b"\0" * 3_000_000)
    try:
        assert jobs.upload_size(ROOT) == before
        assert not any(".venv" in p.parts for p in jobs.upload_files(ROOT))
        assert ROOT / "rayacc" / "cli" / "parser.py" in jobs.upload_files(ROOT)
    finally:
        ignored.unlink()


def test_oversized_upload_is_refused_before_contacting_ray(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(jobs, "MAX_UPLOAD_BYTES", 1024)
    with pytest.raises(jobs.SubmitError, match=r"would upload .* MiB \(limit .*\.gitignore"):
        jobs.submit("jobs/digits.yaml", [], address="http://127.0.0.1:9", follow=False)


def test_job_spec_must_be_inside_the_project(tmp_path, monkeypatch):
    spec = tmp_path / "job.yaml"
    spec.write_text((ROOT / "jobs" / "digits.yaml").read_text())
    monkeypatch.chdir(ROOT)
    with pytest.raises(jobs.SubmitError, match="outside the project"):
        jobs.submit(str(spec), [], address=None, follow=False)


def test_unreachable_address_is_a_clear_error(monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(
        jobs.SubmitError, match="cannot reach the Ray Jobs API at http://127.0.0.1:9"
    ):
        jobs.submit(
            "jobs/digits.yaml", ["train.epochs=1"], address="http://127.0.0.1:9", follow=False
        )
