"""One resume, whatever the door (driver/resume.py): `rayacc train --resume`, `fit(cfg,
resume=True)` on a config read from the job file, and `rayacc submit --resume` (which runs the
first on the cluster) continue the run with the overrides it was started with and those given
now over them. A change the job with only the new overrides could not validate on its own (a
tensor-parallel size without the started run's FSDP) resumes, checked as the merged config."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rayacc import TrainConfig
from rayacc.driver.runs import RunLocation

STARTED = ["train.strategy=fsdp", "train.tensor_parallel=2", "scaling.num_workers=4",
           "optim.lr=0.05", "train.max_steps=7"]  # fmt: skip
NOW = ["train.tensor_parallel=2", "scaling.num_workers=2", "train.max_steps=9"]
"""A resume onto 1 × 2 that names no strategy: alone, the job is DDP × TP (refused)."""


class _Reached(Exception):
    """Raised where the door hands its config on, carrying it."""


def _job(tmp_path: Path) -> Path:
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump(
            {
                "model": {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16},
                "data": {"source": "shakespeare", "seq_len": 16},
                "batch": {"global_batch_size": 8, "micro_batch_size": 2},
                "scaling": {"cpus_per_worker": 0.5},
                "tracking": {"enabled": False},
                "run": {"storage_path": str(tmp_path / "runs"), "name": "started"},
            }
        )
    )
    RunLocation(str(tmp_path / "runs"), "started").record(overrides=STARTED)
    return job


def _expect(cfg: TrainConfig) -> None:
    assert cfg.train.strategy == "fsdp" and cfg.train.tensor_parallel == 2
    assert cfg.scaling.num_workers == 2 and cfg.train.max_steps == 9
    assert cfg.optim.lr == pytest.approx(0.05)


def test_the_job_with_only_the_new_overrides_is_refused_alone(tmp_path):
    from rayacc.config.errors import ConfigError

    with pytest.raises(ConfigError, match="does not compose with train.strategy=ddp"):
        TrainConfig.from_yaml(_job(tmp_path), NOW)


def test_rayacc_train_resume(tmp_path, monkeypatch):
    import rayacc.driver.fit as fit_module
    from rayacc.cli import main

    job = _job(tmp_path)
    seen = {}

    def fit(cfg, **kwargs):
        seen["cfg"], seen["location"] = cfg, kwargs["location"]
        raise _Reached

    monkeypatch.setattr(fit_module, "ensure_ray", lambda scaling: None)
    monkeypatch.setattr(fit_module, "fit", fit)
    assert main(["train", "-c", str(job), "--resume", *NOW]) == 1
    _expect(seen["cfg"])
    # what the run goes on with, recorded for the next resume
    assert seen["location"].overrides == ["train.strategy=fsdp", "optim.lr=0.05", *NOW]


def test_fit_resume_on_a_config_read_from_the_job(tmp_path, monkeypatch):
    import rayacc.driver.fit as fit_module

    job = _job(tmp_path)
    seen = {}

    def holding(prep, loc, *args, **kwargs):
        seen["cfg"], seen["overrides"] = prep.spec.cfg, loc.overrides
        raise _Reached

    monkeypatch.setattr(fit_module, "_fit_holding", holding)
    # a config the user can build: the job with a change that stands alone
    cfg = TrainConfig.from_yaml(job, ["train.max_steps=9"])
    with pytest.raises(_Reached):
        fit_module.fit(cfg, resume=True)
    got = seen["cfg"]
    assert got.train.strategy == "fsdp" and got.train.tensor_parallel == 2
    assert got.scaling.num_workers == 4 and got.train.max_steps == 9
    assert got.optim.lr == pytest.approx(0.05)
    assert "train.max_steps=9" in seen["overrides"] and "train.max_steps=7" not in seen["overrides"]


def test_rayacc_submit_resume_runs_the_same_resume_on_the_cluster(tmp_path, monkeypatch):
    import rayacc.driver.jobs as jobs

    job = _job(tmp_path)
    entrypoint, _ = jobs.job_command(Path("jobs/job.yaml"), NOW, resume=True)
    assert entrypoint.split()[3:5] == ["train", "-c"] and entrypoint.endswith("--resume")

    def client(address):
        raise _Reached

    monkeypatch.setattr(jobs, "_client", client)
    monkeypatch.setattr(jobs, "project_root", lambda cwd: tmp_path)
    monkeypatch.setattr(jobs, "upload_size", lambda root: 0)
    # checked as the resumed run (the merged overrides), before anything is uploaded
    with pytest.raises(_Reached):
        jobs.submit(str(job), NOW, None, False, resume=True)
