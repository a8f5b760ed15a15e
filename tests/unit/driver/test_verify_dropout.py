"""`rayacc verify` compares one step on the cluster with the same step in one process; dropout
draws other masks on each rank than in one process, so no step could agree (stock GPT-2 failed
with a relative difference of 0.98 and no hint). Verify turns off the dropout the config sets,
and says so; a factory's dropout, which it cannot turn off, is refused with the fix."""

from __future__ import annotations

import pytest

from rayacc.config import TrainConfig
from rayacc.config.errors import ConfigError
from rayacc.data.bundled import prepare_bundled
from rayacc.driver.prelaunch import prepare
from rayacc.driver.verify import _refuse_dropout_it_cannot_turn_off, without_dropout
from tests.support.models.hf_configs import tiny_llama

BATCH = {"batch": {"global_batch_size": 16, "micro_batch_size": 8}}


def _cfg(tmp_path, model: dict) -> TrainConfig:
    return TrainConfig.from_dict(
        {
            "model": model,
            "data": {"source": str(prepare_bundled("digits"))},
            "batch": {"global_batch_size": 16, "micro_batch_size": 8},
            "run": {"storage_path": str(tmp_path / "runs")},
        }
    )


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_the_models_own_dropout_is_off_for_the_comparison_and_said(name):
    cfg = TrainConfig.from_dict({**BATCH, "model": {"name": name, "dropout": 0.1}})
    compared, notes = without_dropout(cfg)
    assert compared.model.dropout == 0.0 and cfg.model.dropout == 0.1
    assert notes == ["model.dropout 0.1 → 0 for the comparison"]
    assert without_dropout(compared) == (compared, [])


def test_a_transformers_configs_random_draws_are_off_and_its_other_keys_kept():
    config = {**tiny_llama(64), "attention_dropout": 0.1, "resid_pdrop": 0.2, "layerdrop": 0.0}
    cfg = TrainConfig.from_dict({**BATCH, "model": {"name": "hf", "hf": {"config": config}}})
    compared, notes = without_dropout(cfg)
    got = compared.model.hf.config
    assert got["attention_dropout"] == 0.0 and got["resid_pdrop"] == 0.0
    assert {k: v for k, v in got.items() if k not in ("attention_dropout", "resid_pdrop")} == {
        k: v for k, v in config.items() if k not in ("attention_dropout", "resid_pdrop")
    }
    said = "model.hf.config's attention_dropout 0.1, resid_pdrop 0.2 → 0 for the comparison"
    assert notes == [said]


def test_a_factorys_dropout_is_refused_with_the_fix_and_none_passes(tmp_path):
    factory = "tests.support.models.dropout_model:build"
    cfg = _cfg(tmp_path, {"name": "factory", "factory": factory})
    with pytest.raises(ConfigError) as refused:
        _refuse_dropout_it_cannot_turn_off(cfg, prepare(cfg))
    said = str(refused.value)
    assert "model.factory" in said and "2" in said and "model.kwargs" in said
    off = _cfg(tmp_path, {"name": "factory", "factory": factory, "kwargs": {"p": 0.0}})
    _refuse_dropout_it_cannot_turn_off(off, prepare(off))
