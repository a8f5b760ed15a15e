"""The loss curve of a run as a PNG (an artifact of its MLflow run)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["loss_curve_png"]


def loss_curve_png(history: list[dict[str, Any]], path: Path) -> bool:
    """Train (and validation) loss per optimizer step; False when there is nothing to plot."""
    points = [
        (r["step"], r["train/loss"])
        for r in history
        if "train/loss" in r and math.isfinite(r["train/loss"])
    ]
    if not points:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*points), label="train/loss")
    val = [(r["step"], r["val/loss"]) for r in history if "val/loss" in r]
    if val:
        ax.plot(*zip(*val), "o-", label="val/loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean item loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
