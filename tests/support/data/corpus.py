"""A small text corpus for `rayacc data prepare`, and the token rows it became."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq


def quiet(line: str) -> None:
    pass


def corpus(tmp_path: Path) -> tuple[list[str], bytes]:
    """A text file and a JSONL file; the byte stream the byte-level tokenizer makes of them."""
    text = "First line of a play.\nSecond line: ünïcode.\n" * 40
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    docs = [f"document {i}: " + "lorem ipsum " * (i % 7 + 1) for i in range(60)]
    with open(tmp_path / "b.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d, "id": 1}) + "\n")
    eod = b"\x00"  # placeholder, replaced by id 256 below
    stream = text.encode() + eod + b"".join(d.encode() + eod for d in docs)
    return [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], stream


def rows_of(folder: Path) -> np.ndarray:
    table = pq.read_table(folder)
    return np.array(table["tokens"].to_pylist())
