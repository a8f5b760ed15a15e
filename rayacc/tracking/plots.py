"""The loss curve of a run as a PNG (an artifact of its MLflow run), and where every picture
rayacc draws puts its legend."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

__all__ = ["legend_beside", "loss_curve_png"]


def legend_beside(ax, fontsize: float = 7) -> None:
    """The legend to the right of the axes, outside them: it covers no point (inside, even
    matplotlib's `best` place lands on one when the points fill the axes); the figure's
    `tight_layout` then narrows the axes to make room."""
    if ax.get_legend_handles_labels()[1]:
        ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)


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
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*points), label="train/loss")
    val = [(r["step"], r["val/loss"]) for r in history if "val/loss" in r]
    if val:
        ax.plot(*zip(*val), "o-", label="val/loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean item loss")
    legend_beside(ax, 9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
