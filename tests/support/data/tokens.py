"""Token data of each vocabulary kind and small GPT checkpoints of it, for the tests of
`rayacc sample` and of checkpoint files."""

from __future__ import annotations

from pathlib import Path

import torch

from rayacc.checkpoint import SHARDS_DIR, write_checkpoint
from rayacc.data.prepare import prepare_corpus
from rayacc.data.sources import DatasetInfo, describe_dataset
from rayacc.data.vocab import VOCAB_FILE, Vocabulary
from rayacc.models import build_model

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\nAll: Speak, speak.\n" * 4


def quiet(_line: str) -> None:
    pass


def byte_bpe(tmp_path: Path) -> Path:
    """A byte-level BPE tokenizer.json, as GPT-2's is made."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT], trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def token_data(tmp_path: Path, kind: str) -> DatasetInfo:
    """Token Parquet of each vocabulary kind, as a user gets it."""
    if kind == "chars":
        chars = "".join(sorted(set(TEXT)))
        return DatasetInfo(
            str(tmp_path / "x.parquet"), "tokens", 10, vocab_size=len(chars), vocab=chars
        )
    (tmp_path / "a.txt").write_text(TEXT)
    out = tmp_path / f"data-{kind}"
    if kind == "ids":
        import pyarrow as pa
        import pyarrow.parquet as pq

        out.mkdir()
        rows = [list(range(i, i + 9)) for i in range(20)]
        pq.write_table(pa.table({"tokens": rows}), out / "part-0.parquet")
    else:
        tokenizer = str(byte_bpe(tmp_path)) if kind == "tokenizer" else None
        prepare_corpus(
            [str(tmp_path / "a.txt")], str(out), seq_len=8, tokenizer=tokenizer, progress=quiet
        )
    return describe_dataset(str(out))


def gpt_checkpoint(folder: Path, info: DatasetInfo, *, sharded: bool) -> torch.nn.Module:
    """A checkpoint folder of a small GPT on `info`, as a run writes it (vocab.json included)."""
    from rayacc.config import TrainConfig
    from rayacc.engine.parallel.shards import save_sharded

    cfg = TrainConfig.model_validate(
        {"model": {"name": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 8}}
    )
    model = build_model(cfg, info)
    state = {"train_state": {}}
    if sharded:
        save_sharded(folder / SHARDS_DIR, model, torch.optim.AdamW(model.parameters()))
    else:
        state["model"] = model.state_dict()
    write_checkpoint(
        folder,
        state=state,
        description={"config": cfg.model_dump(mode="json"), "dataset": info.to_dict()},
        meta={"optimizer_step": 3, "shards": SHARDS_DIR if sharded else None},
        files={VOCAB_FILE: Vocabulary.of_data(info).to_json()},
    )
    return model
