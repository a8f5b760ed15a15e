"""A model factory a downloaded checkpoint might name: importing it leaves a mark (the path in
RAYACC_PLANTED_MARK), as code that ran would."""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

if os.environ.get("RAYACC_PLANTED_MARK"):
    Path(os.environ["RAYACC_PLANTED_MARK"]).write_text("imported")


def build(dataset=None, width: int = 4) -> nn.Module:
    return nn.Linear(dataset.num_features if dataset is not None else 2, width)
