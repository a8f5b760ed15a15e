"""The planner's calibration probe on 2 gloo ranks: every rank reaches one verdict."""

from __future__ import annotations

import yaml

from rayacc.config import TrainConfig
from tests.support import ROOT


def test_the_calibration_probe_is_rank_safe(tmp_path):
    """Rank 1 alone runs out of memory at micro-batch 8 (tests/support/models/oom_model.py):
        under DDP both ranks answer "out of memory" and go on; budgets that differ per rank give one
        verdict; under FSDP the rank that ran out raises, so the group fails instead of diverging. A
    tensor-parallel and a pipeline candidate are measured on the same two ranks."""
    import torch

    from rayacc.data.sources import describe_dataset
    from rayacc.driver.calibrate import sample_rows
    from tests.support.data.tokens import token_data
    from tests.support.ranks import planner_workers
    from tests.support.ranks.engine_helpers import spawn_ranks

    job = yaml.safe_load((ROOT / "jobs/digits.yaml").read_text())
    job["data"]["cache_dir"] = str(tmp_path / "cache")
    job["model"] = {
        "name": "factory",
        "factory": "tests.support.models.oom_model:build",
        "kwargs": {"threshold": 8, "always": True, "rank_only": 1},
    }
    cfg = TrainConfig.from_dict(job)
    info = describe_dataset("digits", str(tmp_path / "cache"))
    tokens = token_data(tmp_path, "ids")
    gpt = {"name": "gpt", "n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 8}
    tp_cfg = TrainConfig.from_dict(
        {"model": gpt, "data": {"source": tokens.path, "seq_len": 8},
         "batch": {"global_batch_size": 8}}
    )  # fmt: skip
    torch.save(
        {"cfg": cfg.model_dump(mode="json"), "info": info, "rows": sample_rows(info, 32),
         "tp_cfg": tp_cfg.model_dump(mode="json"), "tp_info": tokens,
         "tp_rows": sample_rows(tokens, 8)},
        tmp_path / "input.pt",
    )  # fmt: skip
    ranks = spawn_ranks(planner_workers.run_rank, 2, tmp_path, "planner probe")
    for r, out in enumerate(ranks):
        assert "error" not in out, out.get("error")
        assert out["ddp_oom"] == {"status": "out of memory"}, r
        assert out["ddp_fits"]["status"] == "measured"
        assert out["budgets"]["status"] == "over budget", r
    assert ranks[0]["ddp_fits"] == ranks[1]["ddp_fits"], "the ranks agree on the figures"
    assert ranks[0]["tensor_parallel"]["status"] == "measured", ranks[0]["tensor_parallel"]
    assert ranks[0]["tensor_parallel"] == ranks[1]["tensor_parallel"]
    # a pipeline's probe runs a window of its schedule on both stages: one verdict, measured
    assert ranks[0]["pipeline"]["status"] == "measured", ranks[0]["pipeline"]
    assert ranks[0]["pipeline"] == ranks[1]["pipeline"]
    assert ranks[0]["pipeline"]["memory_bytes"] > 0
    assert ranks[1]["fsdp_raised"] == "TrialOutOfMemory(8)"
    assert "fsdp" not in ranks[0], "the peer never finished the probe alone"
