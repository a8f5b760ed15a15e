"""`rayacc data prepare FILE... --out DIR`: text and JSONL → token Parquet in row groups the
ranks' reader serves well; bad input named with the fix and nothing half-written."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from rayacc.cli import main
from rayacc.data.common import DataError
from rayacc.data.prepare import prepare_corpus
from rayacc.data.sources import describe_dataset
from tests.support.data.corpus import corpus, quiet, rows_of


def test_byte_level_rows_are_the_text_cut_into_overlapping_windows(tmp_path):
    inputs, stream = corpus(tmp_path)
    out = tmp_path / "tokens"
    result = prepare_corpus(inputs, str(out), seq_len=16, rows_per_group=8, progress=quiet)
    ids = np.frombuffer(stream, dtype=np.uint8).astype(np.int64)
    ids[ids == 0] = 256  # the end-of-document id
    n = (len(ids) - 1) // 16
    expected = np.stack([ids[i * 16 : i * 16 + 17] for i in range(n)])
    assert np.array_equal(rows_of(out), expected)
    meta = pq.ParquetFile(next(out.glob("*.parquet"))).metadata
    assert meta.row_group(0).num_rows == 8
    assert pq.read_schema(next(out.glob("*.parquet"))).field("tokens").type.value_type == "uint16"
    info = describe_dataset(str(out))
    assert (info.num_rows, info.vocab_size, info.max_tokens) == (n, 257, 17)
    assert result.rows == n and result.dtype == "uint16"


def test_a_tokenizer_json_gives_its_ids_and_vocabulary(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    inputs, _ = corpus(tmp_path)
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([inputs[0]], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    out = tmp_path / "words"
    prepare_corpus(
        [inputs[0]],
        str(out),
        seq_len=4,
        tokenizer=str(tmp_path / "tokenizer.json"),
        progress=quiet,
    )
    ids = tok.encode((tmp_path / "a.txt").read_text(), add_special_tokens=False).ids
    assert rows_of(out)[0].tolist() == ids[:5]
    assert describe_dataset(str(out)).vocab_size == tok.get_vocab_size()


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.txt", b"fine\n\xff\xfe broken", "bad.txt: not UTF-8 text at byte 5"),
        ("bad.jsonl", b'{"text": "ok"}\n{"text": oops}\n', "bad.jsonl, line 2: not JSON"),
        ("bad.jsonl", b'{"text": "ok"}\n{"body": "x"}\n', "no text field 'text' (found ['body'])"),
        ("bad.jsonl", b'{"text": "ok"}\n[1, 2]\n', "line 2: no text field 'text' (found list)"),
        (
            "bad.jsonl",
            b'{"text": "ok"}\n{"text": 5}\n',
            "line 2: the text field 'text' holds a int",
        ),
        ("empty", None, "empty: the folder holds no files"),
    ],
)
def test_a_bad_file_is_named_with_the_fix_and_nothing_is_left_behind(
    tmp_path, capsys, name, content, message
):
    inputs, _ = corpus(tmp_path)
    if content is None:
        (tmp_path / name).mkdir()
    else:
        (tmp_path / name).write_bytes(content)
    out = tmp_path / "out"
    code = main(["data", "prepare", *inputs, str(tmp_path / name), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Fix:" in err and "Traceback" not in err, err
    assert not out.exists() and not list(tmp_path.glob(".out*")), "nothing half-written"


def test_out_must_be_new_and_inputs_must_exist(tmp_path):
    inputs, _ = corpus(tmp_path)
    with pytest.raises(DataError, match="exists and is not empty"):
        prepare_corpus(inputs, str(tmp_path), progress=quiet)
    with pytest.raises(DataError, match="no such file or folder"):
        prepare_corpus([str(tmp_path / "missing.txt")], str(tmp_path / "o"), progress=quiet)


def test_flags_of_own_text_given_for_a_bundled_dataset_are_named_as_ignored(tmp_path, capsys):
    code = main(
        ["data", "prepare", "digits", "--cache-dir", str(tmp_path), "--shuffle", "--seq-len", "5"]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "warning: --seq-len, --shuffle ignored: digits is a bundled classification" in (
        captured.err
    )
    assert "digits: 1797 rows" in captured.out
    assert main(["data", "prepare", "digits", "--cache-dir", str(tmp_path)]) == 0
    assert "warning" not in capsys.readouterr().err
