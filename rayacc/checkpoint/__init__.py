"""The checkpoint layer, used by the driver and the worker side alike: the format of a
checkpoint on storage (`format`: names, manifests, meta), the storage seam every file goes
through (`storage`), the reader of untrusted folders (`reader`), the catalogue of a run's
checkpoints (`catalogue`), the lineage spool (`lineage`), the upload of a rank's part
(`upload`) and the run's lease (`lease`). Pure torch and pyarrow: no ray, no mlflow. When to
save and restore is the worker's (`worker/checkpoint.py`)."""

from rayacc.checkpoint.catalogue import Checkpoint, RunCheckpoints
from rayacc.checkpoint.format import (
    HISTORY_FILE,
    META_FILE,
    MODEL_FILE,
    SHARDS_DIR,
    STATE_FILE,
    checkpoint_meta,
    write_checkpoint,
)
from rayacc.checkpoint.lineage import StepLog
from rayacc.checkpoint.reader import (
    CheckpointError,
    load_model,
    malformed_message,
    parse_json,
    read_checkpoint,
)

__all__ = [
    "HISTORY_FILE",
    "META_FILE",
    "MODEL_FILE",
    "SHARDS_DIR",
    "STATE_FILE",
    "Checkpoint",
    "CheckpointError",
    "RunCheckpoints",
    "StepLog",
    "checkpoint_meta",
    "load_model",
    "malformed_message",
    "parse_json",
    "read_checkpoint",
    "write_checkpoint",
]
