"""`rayacc sample`: every kind of vocabulary a token run can have is found in its data, carried by
its checkpoint and decodes what the model generates; checkpoints whole or sharded, named by
folder, run folder or run name. The whole stack (a trained Shakespeare run) is in
test_user_console.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rayacc.checkpoint import RunCheckpoints, write_checkpoint
from rayacc.checkpoint.reader import CheckpointError
from rayacc.cli import main
from rayacc.data.common import DataError
from rayacc.data.sources import DatasetInfo, describe_dataset
from rayacc.data.vocab import VOCAB_FILE, Vocabulary
from rayacc.driver.sample import find_checkpoint, sample
from tests.support.data.tokens import gpt_checkpoint, token_data


@pytest.mark.parametrize("kind", ["chars", "bytes", "tokenizer", "ids"])
def test_each_vocabulary_is_found_in_the_data_and_round_trips(tmp_path, kind):
    info = token_data(tmp_path, kind)
    vocab = Vocabulary.of_data(info)
    assert vocab.kind == kind
    again = Vocabulary.from_json(vocab.to_json())
    assert again == vocab
    text = "12 7 20" if kind == "ids" else "Speak, speak.\nAll:"
    ids = again.encode(text)
    assert all(0 <= i < info.vocab_size for i in ids)
    assert again.decode(ids) == text
    assert again.start() and all(0 <= i < info.vocab_size for i in again.start())


def test_a_classification_source_has_no_vocabulary():
    assert Vocabulary.of_data(DatasetInfo("x", "classification", 10, num_features=4)) is None


def test_byte_data_prepared_before_the_tokenizer_was_recorded_still_decodes(tmp_path):
    import pyarrow.parquet as pq

    info = token_data(tmp_path, "bytes")
    for part in Path(info.path).glob("*.parquet"):
        table = pq.read_table(part)
        meta = {k: v for k, v in table.schema.metadata.items() if k != b"rayacc.tokenizer"}
        pq.write_table(table.replace_schema_metadata(meta), part)
    assert Vocabulary.of_data(describe_dataset(info.path)).kind == "bytes"


@pytest.mark.parametrize(
    "kind, prompt, message",
    [
        ("chars", "Zebra", "the characters 'Z', 'b' are not in the run's vocabulary"),
        ("chars", "€", "the character '€' is not in the run's vocabulary"),
        ("ids", "hello", "the prompt is token ids"),
        ("ids", "1 999", r"token id 999 outside the run's \d+ ids. Fix: give ids in 0\.\."),
        ("ids", "-1 2", "token id -1 outside"),
    ],
)
def test_a_prompt_the_vocabulary_cannot_encode_is_named(tmp_path, kind, prompt, message):
    vocab = Vocabulary.of_data(token_data(tmp_path, kind))
    with pytest.raises(DataError, match=message):
        vocab.encode(prompt)


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "sharded"])
@pytest.mark.parametrize("kind", ["chars", "bytes", "tokenizer", "ids"])
def test_sample_generates_n_tokens_decoded_with_the_runs_vocabulary(tmp_path, kind, sharded):
    info = token_data(tmp_path, kind)
    folder = RunCheckpoints(str(tmp_path / "runs"), "run-a").folder_name(3)
    checkpoint = tmp_path / "runs" / "run-a" / folder
    model = gpt_checkpoint(checkpoint, info, sharded=sharded)
    vocab = Vocabulary.of_data(info)
    prompt = "1 2 3" if kind == "ids" else "All:"
    out = sample(str(checkpoint), prompt=prompt, tokens=12, seed=3)
    assert len(out.ids) == 12 and out.prompt == prompt
    assert out.text == vocab.decode(out.ids)
    # what the command prints: prompt and continuation as one sequence (ids stay apart)
    assert out.whole == vocab.decode(vocab.encode(prompt) + out.ids)
    if kind == "ids":
        assert out.whole.split() == prompt.split() + [str(i) for i in out.ids]
    # the weights sampled are the checkpoint's: greedy decoding matches the model's own
    start = torch.tensor([vocab.encode(prompt)])
    greedy = sample(str(checkpoint), prompt=prompt, tokens=5, temperature=0.0)
    assert greedy.ids == model.generate(start, 5, temperature=0.0)[0, start.shape[1] :].tolist()
    # a seed reproduces a sample
    assert sample(str(checkpoint), prompt=prompt, tokens=12, seed=3).ids == out.ids


def test_rayacc_sample_finds_a_checkpoint_by_folder_run_folder_or_run_name(tmp_path, monkeypatch):
    info = token_data(tmp_path, "chars")
    storage = tmp_path / "rayacc_runs"
    run = RunCheckpoints(str(storage), "shakespeare-1")
    for step in (2, 10):
        gpt_checkpoint(storage / "shakespeare-1" / run.folder_name(step), info, sharded=False)
    latest = str(storage / "shakespeare-1" / run.folder_name(10))
    first = str(storage / "shakespeare-1" / run.folder_name(2))
    assert find_checkpoint(first) == first
    assert find_checkpoint(str(storage / "shakespeare-1")) == latest
    assert find_checkpoint("shakespeare-1", storage=str(storage)) == latest
    monkeypatch.chdir(tmp_path)
    assert find_checkpoint("shakespeare-1") == latest  # ./rayacc_runs
    # or the MLflow run id the run's summary printed: its folder records it, whatever the store
    from rayacc.driver.runs import RUN_INFO

    mlflow_id = "0123456789abcdef0123456789abcdef"
    (storage / "shakespeare-1" / RUN_INFO).write_text(
        json.dumps({"mlflow_run_id": mlflow_id, "status": "finished"})
    )
    assert find_checkpoint(mlflow_id) == latest
    with pytest.raises(CheckpointError, match="tracked as this MLflow run"):
        find_checkpoint("fedcba9876543210fedcba9876543210")


def test_rayacc_sample_prints_the_prompt_and_n_tokens(tmp_path, capsys):
    info = token_data(tmp_path, "chars")
    checkpoint = tmp_path / "ckpt"
    gpt_checkpoint(checkpoint, info, sharded=False)
    assert (
        main(["sample", str(checkpoint), "--prompt", "All:", "--tokens", "30", "--seed", "1"]) == 0
    )
    out, err = capsys.readouterr()
    assert out.startswith("All:") and len(out) == len("All:") + 30 + 1  # + the line break
    assert "30 tokens from" in err and "characters" in err


@pytest.mark.parametrize(
    "make, args, message",
    [
        (None, ["nowhere-run"], "neither a checkpoint folder"),
        ("classification", [], "generates text from token models"),
        # the flags' ranges: tests/unit/cli/test_cli_flags.py (argparse refuses them first)
        ("chars", ["--prompt", "Zebra"], "not in the run's vocabulary"),
    ],
)
def test_rayacc_sample_refuses_with_the_fix(tmp_path, capsys, monkeypatch, make, args, message):
    monkeypatch.chdir(tmp_path)
    target = str(tmp_path / "ckpt")
    if make == "classification":
        write_checkpoint(
            target,
            state={},
            description={"config": {}, "dataset": {"format": "classification"}},
            meta={"optimizer_step": 1},
        )
    elif make:
        gpt_checkpoint(Path(target), token_data(tmp_path, make), sharded=False)
    argv = ["sample", *(args if make is None else [target, *args])]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_checkpoint_carries_the_runs_vocabulary(tmp_path):
    info = token_data(tmp_path, "tokenizer")
    gpt_checkpoint(tmp_path / "c", info, sharded=False)
    saved = json.loads((tmp_path / "c" / VOCAB_FILE).read_text())
    assert (
        saved["kind"] == "tokenizer"
        and json.loads(saved["tokenizer_json"])["model"]["type"] == "BPE"
    )
