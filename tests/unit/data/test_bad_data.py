"""Bad data is caught on the driver in one streamed pass, naming the file, the row and the fix."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayacc.config import ConfigError, TrainConfig
from rayacc.data.common import VOCAB_KEY, DataError
from rayacc.data.sources import describe_dataset


def classification(path: Path, features, labels) -> str:
    pq.write_table(
        pa.table({"features": pa.array(features, pa.list_(pa.float32())), "label": labels}),
        path,
        row_group_size=4,  # the bad row sits in a later batch than the first
    )
    return str(path)


def tokens(path: Path, rows, vocab: str | None = None) -> str:
    table = pa.table({"tokens": pa.array(rows, pa.list_(pa.int64()))})
    if vocab is not None:
        table = table.replace_schema_metadata({VOCAB_KEY: vocab.encode()})
    pq.write_table(table, path)
    return str(path)


GOOD = [[0.0, 1.0]] * 10


@pytest.mark.parametrize(
    "features, labels, row, problem",
    [
        ([*GOOD[:6], [0.0, math.nan], *GOOD[:3]], [0] * 10, 6, "NaN or Inf"),
        ([*GOOD[:7], [math.inf, 0.0], *GOOD[:2]], [0] * 10, 7, "NaN or Inf"),
        ([*GOOD[:5], None, *GOOD[:4]], [0] * 10, 5, "`features` is null"),
        ([*GOOD[:5], [0.0, None], *GOOD[:4]], [0] * 10, 5, "null entry"),
        ([*GOOD[:8], [0.0, 1.0, 2.0], *GOOD[:1]], [0] * 10, 8, "3 values where earlier rows"),
        (GOOD, [0] * 9 + [-1], 9, "`label` is -1"),
        (GOOD, [0] * 4 + [10**9] + [0] * 5, 4, "would build a classifier"),
    ],
    ids=["nan", "inf", "null-row", "null-entry", "length", "negative-label", "huge-label"],
)
def test_a_bad_classification_row_is_named(tmp_path, features, labels, row, problem):
    path = classification(tmp_path / "bad.parquet", features, labels)
    with pytest.raises(DataError) as err:
        describe_dataset(path)
    message = str(err.value)
    assert f"bad.parquet, row {row}:" in message and problem in message, message
    assert "Fix:" in message


@pytest.mark.parametrize(
    "rows, vocab, row, problem",
    [
        ([[1, 2, 3]] * 3 + [[1, -4, 2]], None, 3, "token id -4"),
        ([[1, 2]] * 2 + [[1, 2**40]], None, 2, "would build an embedding"),
        ([[0, 1, 2]] * 2 + [[0, 3, 1]], "abc", 2, "outside the vocabulary of 3"),
        ([[0, 1]] * 2 + [[1]], None, 2, "fewer than 2 tokens"),
    ],
    ids=["negative", "huge", "outside-vocab", "short"],
)
def test_a_bad_token_row_is_named(tmp_path, rows, vocab, row, problem):
    path = tokens(tmp_path / "tok.parquet", rows, vocab)
    with pytest.raises(DataError) as err:
        describe_dataset(path)
    message = str(err.value)
    assert f"tok.parquet, row {row}:" in message and problem in message, message


def test_a_file_ray_data_would_skip_is_named(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    classification(folder / "part-0.parquet", GOOD, [0] * 10)
    classification(folder / "part-1.snappy", GOOD, [1] * 10)
    with pytest.raises(DataError, match=r"part-1.snappy does not end in .parquet"):
        describe_dataset(str(folder))


def test_good_data_still_describes(tmp_path):
    info = describe_dataset(classification(tmp_path / "ok.parquet", GOOD, [0, 1] * 5))
    assert (info.num_rows, info.num_features, info.num_classes) == (10, 2, 2)
    tok = describe_dataset(tokens(tmp_path / "t.parquet", [[0, 1, 2], [2, 1]], "abc"))
    assert (tok.vocab_size, tok.max_tokens) == (3, 3)


def test_a_negative_seed_is_a_config_error():
    with pytest.raises(ConfigError, match="seed"):
        TrainConfig.from_dict({"seed": -1, "batch": {"global_batch_size": 8}})


@pytest.mark.parametrize(
    ("rows", "val_fraction", "global_batch", "last_window", "train_rows"),
    [
        (151, 0.0, 256, "short", 151),  # one short window would be all the run has
        (151, 0.0, 256, "drop", 151),  # no window at all
        (256, 0.5, 256, "short", 128),  # the held-out rows leave too few
        (256, 0.0, 256, "short", None),  # exactly one global batch: fine
        (300, 0.1, 256, "short", None),
    ],
)
def test_a_global_batch_larger_than_the_training_rows_names_both(
    tmp_path, rows, val_fraction, global_batch, last_window, train_rows
):
    from rayacc.driver.prelaunch import prepare

    source = classification(
        tmp_path / "d.parquet", [[0.0, 1.0]] * rows, [0, 1] * (rows // 2) + [0] * (rows % 2)
    )
    cfg = TrainConfig.from_dict(
        {
            "data": {
                "source": source,
                "val_fraction": val_fraction,
                "last_window": last_window,
                "order": "rows",
            },
            "batch": {"global_batch_size": global_batch, "micro_batch_size": 8},
        }
    )
    if train_rows is None:
        assert prepare(cfg).split.global_batch_size == global_batch
        return
    with pytest.raises(DataError) as err:
        prepare(cfg)
    message = str(err.value)
    assert f"batch.global_batch_size={global_batch}" in message
    assert f"{train_rows} training rows" in message and f"at most {train_rows}" in message


def test_a_batch_schedules_phase_larger_than_the_training_rows_is_named(tmp_path):
    from rayacc.driver.prelaunch import prepare

    source = classification(tmp_path / "d.parquet", [[0.0, 1.0]] * 150, [0, 1] * 75)
    phases = [
        {"from_samples": 64, "global_batch_size": 128},
        {"from_samples": 256, "global_batch_size": 256},
    ]
    cfg = TrainConfig.from_dict(
        {
            "data": {"source": source, "val_fraction": 0.0, "order": "rows"},
            "batch": {"global_batch_size": 32, "micro_batch_size": 8, "schedule": phases},
        }
    )
    with pytest.raises(DataError) as err:
        prepare(cfg)
    assert "batch.schedule[1].global_batch_size=256 is more than the 150 training rows" in str(
        err.value
    )


def test_a_schedule_in_tokens_on_rows_that_are_not_tokens_is_named(tmp_path):
    from rayacc.driver.prelaunch import prepare

    source = classification(tmp_path / "d.parquet", [[0.0, 1.0]] * 150, [0, 1] * 75)
    cfg = TrainConfig.from_dict(
        {
            "data": {"source": source, "val_fraction": 0.0, "order": "rows"},
            "batch": {
                "global_batch_size": 32,
                "micro_batch_size": 8,
                "schedule": [{"from_tokens": 640, "global_batch_size": 64}],
            },
        }
    )
    with pytest.raises(DataError) as err:
        prepare(cfg)
    assert "batch.schedule[0].from_tokens" in str(err.value) and "from_samples" in str(err.value)


@pytest.mark.parametrize(
    ("factory", "kwargs", "says"),
    [
        (":good", {}, "is not `package.module:function`"),
        ("tests.support.no_such_module:build", {}, "cannot import 'tests.support.no_such_module'"),
        (
            "tests.support.models.bad_factory_import:build",
            {},
            "RuntimeError: this module is broken",
        ),
        ("tests.support.models.bad_factories:missing", {}, "has no callable 'missing'"),
        ("tests.support.models.bad_factories:not_callable", {}, "has no callable 'not_callable'"),
        ("tests.support.models.bad_factories:raises", {}, "ValueError: bad hidden size"),
        ("tests.support.models.bad_factories:no_dataset", {}, "TypeError"),
        (
            "tests.support.models.bad_factories:good",
            {"depth": 3},
            "TypeError",
        ),  # a kwarg it does not take
        ("tests.support.models.bad_factories:returns_int", {}, "returned int, not an nn.Module"),
    ],
)
def test_a_model_factory_that_cannot_build_the_model_is_refused_before_launch(
    tmp_path, factory, kwargs, says
):
    from rayacc.driver.prelaunch import prepare
    from rayacc.models import ModelError

    cfg = TrainConfig.from_dict(
        {
            "model": {"name": "factory", "factory": factory, "kwargs": kwargs},
            "data": {"source": "digits"},
            "batch": {"global_batch_size": 32, "micro_batch_size": 8},
        }
    )
    with pytest.raises(ModelError) as err:
        prepare(cfg)
    message = str(err.value)
    assert says in message and f"model.factory={factory!r}" in message, message
    assert "Fix:" in message and "nn.Module" in message


def test_a_model_factory_that_builds_passes(tmp_path):
    from rayacc.driver.prelaunch import prepare

    cfg = TrainConfig.from_dict(
        {
            "model": {"name": "factory", "factory": "tests.support.models.bad_factories:good"},
            "data": {"source": "digits"},
            "batch": {"global_batch_size": 32, "micro_batch_size": 8},
        }
    )
    assert prepare(cfg).num_parameters == 64 * 10 + 10


def test_wrong_columns_are_reported_before_workers_start(tmp_path):
    from rayacc.driver.prelaunch import prepare
    from tests.support.services.fits import config

    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"x": [1.0, 2.0]}), path)
    cfg = config(tmp_path, data={"source": str(path)})
    with pytest.raises(DataError, match=r"match no format.*`features`"):
        prepare(cfg)
