"""Every picture rayacc draws puts its legend beside the axes (`tracking/plots.py::
legend_beside`): the class is every `legend(` call in the package, and the check is drawn —
the legend's box clear of the axes' box and inside the figure, with points filling the axes
(where matplotlib's own `best` place lands on one: a sweep plot's best trial was covered)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rayacc.tracking.plots import legend_beside

PACKAGE = Path(__file__).resolve().parents[3] / "rayacc"


def test_every_legend_in_the_package_is_placed_beside_its_axes():
    calls = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for path in PACKAGE.rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\.legend\(", line)
    ]
    import inspect

    lines, first = inspect.getsourcelines(legend_beside)
    own = [f"tracking/plots.py:{n}" for n in range(first, first + len(lines))]
    assert len(calls) == 1 and calls[0] in own, calls  # legend_beside's own, alone


@pytest.mark.parametrize("entries", [1, 7, 20])
def test_a_legend_beside_covers_no_point(entries):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4.2))
    for i in range(entries):  # points in every corner and along every edge
        ax.plot([1, 2, 4, 8, 16], [0, 10, 5 + i, 10, 0], "o-", label=f"trial {i}: micro 64")
    legend_beside(ax)
    fig.tight_layout()
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    axes = ax.get_window_extent()
    figure = fig.bbox
    assert legend.x0 >= axes.x1, (legend, axes)
    assert legend.x1 <= figure.x1 + 1 and legend.y1 <= figure.y1 + 1, (legend, figure)
    assert legend.y0 >= figure.y0 - 1, (legend, figure)
    plt.close(fig)
