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


def reseal(folder: Path) -> Path:
    """Writes rank 0's part of the checkpoint in `folder` again (as a run writes it), so that
    meta.json lists every file now in the folder: one a test put in after it was written (a
    lineage) included."""
    import json

    import torch

    from rayacc.checkpoint import MODEL_FILE, STATE_FILE
    from rayacc.checkpoint.format import FILES_KEY, META_FILE

    meta = json.loads((folder / META_FILE).read_text())
    meta.pop(FILES_KEY, None)
    return write_checkpoint(
        folder,
        state=torch.load(folder / STATE_FILE, weights_only=True),
        description=json.loads((folder / MODEL_FILE).read_text()),
        meta=meta,
    )
