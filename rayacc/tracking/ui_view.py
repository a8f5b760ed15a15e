"""The experiment's saved view in MLflow's UI, loss first: MLflow 3 keeps a saved view as an
experiment tag (`mlflow.sharedViewState.<id>`, an envelope holding the view's state as JSON)
and opens it from a link (`viewStateShareKey=<id>`, `observe/console.py::charts_link`). Its
runs table shows the global batch, the effective LR and the last loss beside each run; its
charts open on `train/`, `val/` and `scaling/`, the diagnostics behind (the UI appends the
sections it meets, in their order). A run's own page orders its sections by name in the
browser: MLflow offers no setting for it."""

from __future__ import annotations

import json

from rayacc.observe.console import SAVED_VIEW

__all__ = ["LEADING_SECTIONS", "TABLE_COLUMNS", "VIEW_TAG", "saved_view"]

VIEW_TAG = f"mlflow.sharedViewState.{SAVED_VIEW}"
VIEW_NAME = "rayacc: loss first"
LEADING_SECTIONS = ("train", "val", "scaling")
"""The chart sections the view opens on, in this order; every other section follows."""
TABLE_COLUMNS = (
    ("attributes", "Dataset"),
    ("params", "global_batch_size"),
    ("params", "effective_lr"),
    ("metrics", "train/loss"),
    ("metrics", "val/loss"),
    ("metrics", "val/accuracy"),
)
"""The runs table's columns besides the run's name, creation and duration (a metric's column
shows its value at the last step)."""


def saved_view(now_ms: int) -> str:
    """The tag's value: MLflow's envelope around the view's state (its UI's own field names;
    `compareRunCharts: []` lets the UI chart every metric into the sections given)."""
    state = {
        "selectedColumns": [f"{kind}.`{name}`" for kind, name in TABLE_COLUMNS],
        "compareRunCharts": [],
        "compareRunSections": [
            dict(uuid=f"rayacc-{n}", name=n, display=True, isReordered=False, deleted=False)
            for n in LEADING_SECTIONS
        ],
        "isAccordionReordered": True,  # the order given, not the UI's sort by name
    }
    return json.dumps(
        {"name": VIEW_NAME, "createdAt": now_ms, "updatedAt": now_ms, "state": json.dumps(state)}
    )
