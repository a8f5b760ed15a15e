"""A strategy from another package: a second DDP under another name, in a package of its own
that registers it under the entry-point group `rayacc.strategies` (its dist-info beside it), as
`pip install` would lay it out. Nothing of rayacc names it."""

from __future__ import annotations

from pathlib import Path

NAME = "twin"
WING = '''"""A second DDP under another name."""

from rayacc.engine.parallel.ddp import DDP


class Twin(DDP):
    name = "twin"
'''
CLASS = "rayacc_twin:Twin"


def write_package(root: Path, entry: str = NAME, dist: str = "rayacc_twin") -> Path:
    """The package under `root` (put `root` on sys.path or PYTHONPATH to install it), its entry
    point named `entry`; returns `root`."""
    package = root / "rayacc_twin"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text(WING)
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[rayacc.strategies]\n{entry} = {CLASS}\n")
    return root
