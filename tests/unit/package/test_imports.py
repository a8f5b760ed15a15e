import subprocess
import sys


def test_engine_and_checkpoint_layer_load_neither_ray_nor_mlflow():
    code = (
        "import sys, rayacc.engine, rayacc.config, rayacc.checkpoint\n"
        "import rayacc.checkpoint.upload, rayacc.checkpoint.lease\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'mlflow'))\n"
        "assert 'torch' in sys.modules\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"engine import pulled in: {out.stdout.strip()}"


def test_config_layer_does_not_import_the_engine():
    code = (
        "import sys, rayacc.config; print('rayacc.engine' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def _rayacc_imports(package: str) -> dict[str, set[str]]:
    """Every rayacc module each module of `package` imports, at its top or inside a function."""
    import ast
    from pathlib import Path

    import rayacc

    root = Path(rayacc.__file__).parent
    found: dict[str, set[str]] = {}
    for path in sorted((root / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        found[str(path.relative_to(root))] = {n for n in names if n.startswith("rayacc")}
    return found


def test_code_is_sorted_by_the_process_that_runs_it():
    """The worker side never imports the driver side; the planner's pure part imports neither
    (its Ray part, the calibration, is the driver's); what a run tells its observers and the
    cluster code import neither either."""
    rules = {
        "worker": ("rayacc.driver",),
        "planner": ("rayacc.driver", "rayacc.worker"),
        "observe": ("rayacc.driver", "rayacc.worker"),
        "cluster": ("rayacc.driver", "rayacc.worker"),
        "engine": ("rayacc.driver", "rayacc.worker", "rayacc.planner", "rayacc.tracking"),
        # the checkpoint layer: beneath both sides, which both use it
        "checkpoint": (
            "rayacc.driver",
            "rayacc.worker",
            "rayacc.planner",
            "rayacc.tracking",
            "rayacc.observe",
        ),
    }
    wrong = [
        f"{module} imports {name}"
        for package, banned in rules.items()
        for module, names in _rayacc_imports(package).items()
        for name in names
        if name.startswith(banned)
    ]
    assert not wrong, wrong


def test_at_most_six_modules_sit_at_the_top_of_the_package():
    from pathlib import Path

    import rayacc

    top = sorted(p.name for p in Path(rayacc.__file__).parent.glob("*.py"))
    assert len(top) <= 6, top


LAYERS = [
    ("redact", "env"),
    ("config",),
    ("engine", "cluster"),
    ("optim", "data"),
    ("models",),
    ("rank",),
    ("run", "checkpoint"),
    ("observe", "planner"),
    ("worker", "tracking"),
    ("driver",),
    ("cli",),
]
"""The package's layers, lowest first, as docs/design.md ("Layers") draws them: a module
imports only from its own unit or from a lower layer (never sideways, never up). The package's
`__init__` (the public API) sits on top."""


def test_imports_flow_one_way_through_the_layers():
    import ast
    from pathlib import Path

    import rayacc

    root = Path(rayacc.__file__).parent
    level = {unit: i for i, units in enumerate(LAYERS) for unit in units}
    units = {p.stem if p.suffix == ".py" else p.name for p in root.iterdir()}
    units -= {"__init__", "__pycache__"}
    assert units == set(level), f"units without a layer or gone: {units ^ set(level)}"
    wrong = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        unit = rel.parts[0].removesuffix(".py")
        if unit == "__init__":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
                if node.module == "rayacc":
                    names = [f"rayacc.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] != "rayacc" or len(parts) < 2 or parts[1] == unit:
                    continue
                if level[parts[1]] >= level[unit]:
                    wrong.append(f"{rel} imports {name}")
    assert not wrong, wrong
