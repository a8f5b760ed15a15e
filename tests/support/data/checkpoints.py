"""Checkpoint folders made by hand for tests of what reads them: whole (every file its
manifest lists), holding only what the reader under test looks at."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rayacc.checkpoint import write_checkpoint


def minimal_checkpoint(folder: Path, meta: dict[str, Any]) -> Path:
    """A whole checkpoint folder with `meta` (its state and model description empty: enough
    for the catalogue, the runs list and a resume's checks, not for load_model)."""
    return write_checkpoint(
        folder,
        state={"train_state": {}},
        description={"config": {}, "dataset": {}},
        meta=meta,
    )
