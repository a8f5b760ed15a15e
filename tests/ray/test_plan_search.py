"""`rayacc plan --search`, a `rayacc sweep` of the plan's best two, then `rayacc train --plan`
on the shared local Ray: the table, the pruning by the memory budget, PLAN.yaml, the MLflow
record, the sweep's console (rayacc's lines only: no Tune reporter, no Ray records) and verdict,
and the run of the plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rayacc.cli import main
from tests.support.services.cli import assert_only_rayaccs_lines, rayacc_process

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]


def test_plan_search_then_train_with_the_plan(ray_address, tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    job = str(ROOT / "jobs/digits.yaml")
    # a memory budget below what micro-batches of 128 and more need (about 0.6 MiB on
    # digits); a time budget that does not bind on a loaded machine (120 s once did)
    code = main(
        [
            # the top candidate only: one calibration group, at its worker count (a top two
            # at different counts would start one more; choosing among measured ones is a
            # unit test, tests/unit/planner/test_planner.py)
            "plan", "-c", job, "--search", "--top", "1", "--budget-s", "1200",
            "--out", "plans/P.yaml", "batch.memory_budget_mb=0.55",
            # one worker a node: 2 workers span 2 nodes, where HSDP is a candidate
            "scaling.workers_per_node=1",
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    table = out[out.index("candidate ") :]
    assert "pruned: needs" in table and "the budget is 0.55 MiB" in table, table
    assert "← chosen" in table
    assert "time budget (" not in out, out
    assert "median error of the prior over 1 measured" in out
    plan = yaml.safe_load((tmp_path / "plans/P.yaml").read_text())
    chosen = plan["chosen"]
    labels = {c["label"].split(" ac=")[0].split(" ", 2)[-1] for c in plan["candidates"]}
    assert {
        "fsdp every_micro_step hsdp 2×1",
        "fsdp window_end hsdp 2×1",
        "fsdp every_micro_step offload",
    } <= labels, labels
    measured = [c for c in plan["candidates"] if c.get("status") == "measured"]
    assert len(measured) == 1 and measured[0]["measured_memory_mb"] <= 0.55
    assert chosen["label"] == measured[0]["label"]
    assert not any(c["fits"] for c in plan["candidates"] if c["micro_batch_size"] >= 128)
    assert plan["made_for"]["global_batch_size"] == 256
    # the table and the plan are in MLflow
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs(
        [client.get_experiment_by_name("rayacc-digits").experiment_id],
        filter_string="tags.`rayacc.kind` = 'plan'",
    )
    names = {a.path for a in client.list_artifacts(run.info.run_id, "plan")}
    assert names == {"plan/table.txt", "plan/PLAN.yaml"}
    assert run.data.params["chosen"] == chosen["label"]
    assert not list(tmp_path.glob("rayacc_runs/rayacc-plan-*")), "calibration folders removed"

    # a sweep of the plan's best two, at the same global batch, with the prior beside
    sweep = {
        "base": job,
        "overrides": ["train.max_steps=3", "train.checkpoint_every_steps=null"],
        "plan": "plans/P.yaml",
        "from_plan": 2,
    }
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    # the command as a user runs it, joining the suite's Ray
    swept = rayacc_process(
        ["sweep", "-c", "sweep.yaml"], cwd=tmp_path, timeout=400, RAY_ADDRESS=ray_address
    )
    assert swept.returncode == 0, swept.stdout + swept.stderr
    assert_only_rayaccs_lines(swept)
    out = swept.stdout
    assert "same final loss" in out and "in all 2 trials" in out, out
    assert "as expected at one global batch; fastest: trial" in out, out
    assert "by throughput" in out and "by peak memory" in out, out
    assert "the plan's prior vs the trials (median |step-time error|" in out, out

    code = main(["train", "-c", job, "--plan", "plans/P.yaml", "train.max_steps=2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "settings from the plan plans/P.yaml" in out
    assert (
        f"global batch 256 = micro {chosen['micro_batch_size']} × accum "
        f"{chosen['grad_accum_steps']} × workers {chosen['workers']}"
    ) in out
