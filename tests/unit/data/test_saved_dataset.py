"""Hugging Face `datasets` folders (`save_to_disk`, written here by the real `datasets`):
`data.source` takes one of token ids (a Dataset, or a DatasetDict's `train` split), `rayacc
data prepare` tokenizes one of text, and a folder that is not one as `datasets` writes it is
named with the fix — never read outside itself."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

datasets = pytest.importorskip("datasets")

from rayacc.data.common import DataError  # noqa: E402
from rayacc.data.prepare import prepare_corpus  # noqa: E402
from rayacc.data.sources import describe_dataset  # noqa: E402

ROWS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]


def test_a_dataset_of_input_ids_is_a_source(tmp_path):
    folder = tmp_path / "ds"
    datasets.Dataset.from_dict({"input_ids": ROWS, "attention_mask": ROWS}).save_to_disk(folder)
    info = describe_dataset(str(folder), str(tmp_path / "cache"))
    assert (info.format, info.num_rows, info.max_tokens) == ("tokens", 3, 5)
    assert pq.read_table(info.path)["tokens"].to_pylist() == ROWS
    # the conversion is made once per version of the dataset
    assert describe_dataset(str(folder), str(tmp_path / "cache")).path == info.path


def test_a_dataset_dict_trains_on_its_train_split(tmp_path):
    folder = tmp_path / "dd"
    train = datasets.Dataset.from_dict({"tokens": ROWS})
    test = datasets.Dataset.from_dict({"tokens": ROWS[:1]})
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(folder)
    assert describe_dataset(str(folder), str(tmp_path / "cache")).num_rows == 3
    datasets.DatasetDict({"validation": test}).save_to_disk(tmp_path / "nt")
    with pytest.raises(DataError, match=r"without a `train` split \(splits: validation\)"):
        describe_dataset(str(tmp_path / "nt"), str(tmp_path / "cache"))


def test_a_dataset_of_text_is_named_with_the_command_that_tokenizes_it(tmp_path):
    folder = tmp_path / "text"
    datasets.Dataset.from_dict(
        {"text": ["to be or not to be", "that is the question"]}
    ).save_to_disk(folder)
    with pytest.raises(DataError, match="rayacc data prepare"):
        describe_dataset(str(folder), str(tmp_path / "cache"))
    done = prepare_corpus([str(folder)], str(tmp_path / "out"), seq_len=4, progress=lambda _: None)
    assert done.rows > 0
    info = describe_dataset(str(tmp_path / "out"))
    assert info.format == "tokens"
    with pytest.raises(DataError, match="without a 'body' column"):
        prepare_corpus(
            [str(folder)], str(tmp_path / "o2"), text_field="body", progress=lambda _: None
        )


def test_a_state_json_naming_a_file_elsewhere_is_refused(tmp_path):
    folder = tmp_path / "ds"
    datasets.Dataset.from_dict({"input_ids": ROWS}).save_to_disk(folder)
    (tmp_path / "secret.arrow").write_bytes(b"x")
    state = json.loads((folder / "state.json").read_text())
    state["_data_files"] = [{"filename": "../secret.arrow"}]
    (folder / "state.json").write_text(json.dumps(state))
    with pytest.raises(DataError, match="not a file of it"):
        describe_dataset(str(folder), str(tmp_path / "cache"))
