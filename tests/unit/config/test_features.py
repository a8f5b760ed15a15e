"""The one acceptance of feature pairs (config/features.py), generated from its registry: every
pair of features either is declared by both and accepted by the whole validator, or is refused
before launch naming both keys, why and a fix. A feature added tomorrow is in these pairs the day
it lands; `rayacc plan` and `prepare` run the same check on the data's kind."""

from __future__ import annotations

import itertools
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayacc.cli import main
from rayacc.config import ConfigError, TrainConfig
from rayacc.config.features import DATA, DataKind, declared, features
from rayacc.config.overrides import apply_overrides
from rayacc.config.strategies import strategies

BASE = {
    "model": {"name": "gpt", "n_layer": 4, "n_head": 4, "n_embd": 32, "block_size": 16},
    "data": {"seq_len": 16},
    "batch": {"global_batch_size": 32, "micro_batch_size": 4},
    "train": {"max_steps": 4},
    "scaling": {"num_workers": 4, "use_gpu": True},
    "tracking": {"enabled": False},
}
"""A config every feature can be turned on in (GPU workers: DeepSpeed's fp16 needs one)."""

FOUND = features()
PAIRS = [(a, b) for a, b in itertools.combinations(FOUND, 2) if FOUND[a].key != FOUND[b].key]
"""Every pair that can be on together (one key's values exclude each other)."""


def _able(names: tuple[str, ...]) -> list[str]:
    """The strategies that declare every feature of `names` (a strategy among them: itself)."""
    if own := [n for n in names if n in strategies()]:
        return own
    return [s for s in strategies() if all(declared(s, n) for n in names)]


def _config(names: tuple[str, ...]) -> dict[str, Any]:
    """BASE with the features `names` turned on, under a strategy that declares all of them
    where one does (else the default's refusal would stand in the pair's way)."""
    on: dict[str, Any] = {}
    if not any(n in strategies() for n in names):
        on["train.strategy"] = (_able(names) or ["ddp"])[0]
    for name in names:
        on.update(FOUND[name].turn_on)
    return apply_overrides(BASE, [f"{k}={_yaml(v)}" for k, v in on.items()], [], TrainConfig)


def _yaml(value: Any) -> str:
    import json

    return json.dumps(value)


def _kind(names: tuple[str, ...]) -> DataKind:
    return DataKind(**{n: True for n in names if n in DATA})


def _validate(names: tuple[str, ...]) -> list[str]:
    """The issues the config with `names` on gets, as their text (empty: accepted)."""
    try:
        cfg = TrainConfig.from_dict(_config(names))
        cfg.check_data_kind(_kind(names))
    except ConfigError as exc:
        return [str(i) for i in exc.issues]
    return []


def test_every_feature_can_be_turned_on_and_declares_itself_with_reasons():
    for name, f in FOUND.items():
        assert f.turn_on or name in DATA, f"{name} gives no keys that turn it on"
        assert _validate((name,)) == [], name
        refused = [o for o in FOUND if FOUND[o].key != f.key and not declared(name, o)]
        # a refused pair says why from one side at least
        for other in refused:
            assert other in f.refuses or name in FOUND[other].refuses, (name, other)


@pytest.mark.parametrize("pair", PAIRS, ids="×".join)
def test_a_pair_is_accepted_where_both_declare_it_and_refused_naming_both_keys(pair):
    a, b = (FOUND[n] for n in pair)
    issues = _validate(pair)
    if declared(*pair) and _able(pair):
        assert issues == [], issues
        return
    if declared(*pair):  # no strategy declares both: the strategy's pair is what is refused
        assert issues and all("does not compose with train.strategy=" in i for i in issues)
        return
    named = [i for i in issues if "does not compose with" in i]
    assert len(named) == 1, issues
    text = named[0]
    assert text.startswith((a.key, b.key)) and "Fix:" in text, text
    other = b if text.startswith(a.key) and a.key != b.key else a
    assert other.key in text.split(":", 1)[1], text


def test_the_pairs_are_printed_with_their_coverage(capsys):
    accepted = sum(declared(*p) and bool(_able(p)) for p in PAIRS)
    strategyless = sum(declared(*p) and not _able(p) for p in PAIRS)
    with capsys.disabled():
        print(f"\nfeature pairs: {len(PAIRS)} over {len(FOUND)} features: {accepted} declared "
              f"and accepted, {strategyless} declared with no strategy declaring both, "
              f"{len(PAIRS) - accepted - strategyless} refused before launch")  # fmt: skip
    assert 0 < accepted < len(PAIRS)


def test_plan_reads_the_datas_kind_and_refuses_what_train_would(tmp_path, capsys):
    """Packed rows × a pipeline: `rayacc plan` (no --memory, no pass over the rows) refuses
    it as `train` does, exit 2, naming both keys."""
    table = pa.table({"tokens": [[1, 2, 3, 4]] * 8, "documents": [[0, 0, 1, 1]] * 8})
    pq.write_table(table, tmp_path / "packed.parquet")
    job = tmp_path / "job.yaml"
    cfg = _config(("pipeline",))
    cfg["data"] = {"source": str(tmp_path / "packed.parquet"), "seq_len": 4, "val_fraction": 0}
    cfg["scaling"] = {"num_workers": 2}
    import yaml

    job.write_text(yaml.safe_dump(cfg))
    assert main(["plan", "-c", str(job)]) == 2
    err = capsys.readouterr().err
    assert "data.source: holds packed rows" in err and "train.pipeline_parallel=2" in err, err
    assert "Traceback" not in err
    # the same config on unpacked rows plans
    pq.write_table(table.drop(["documents"]), tmp_path / "packed.parquet")
    assert main(["plan", "-c", str(job)]) == 0, capsys.readouterr().err
