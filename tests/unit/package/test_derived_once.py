"""The run is derived once: after `derive_run` has built the RunSpec, the driver's path reads it
(or the one config section a step needs), and the whole config is not handed on again.

The walk follows the config from `driver/fit.py::fit` through every call that receives it (by
name, or as a `.cfg` read through the spec), in source order; a call made after the RunSpec
exists that hands the whole config on is a climb back up to it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "rayacc"
START = ("rayacc.driver.fit", "fit", "cfg")
DERIVES = {("rayacc.run.spec", "derive_run"), ("rayacc.driver.prelaunch", "prepare")}
MOST_CLIMBS = 8


@dataclass(frozen=True)
class Site:
    caller: str
    line: int
    callee: str

    def __str__(self) -> str:
        return f"{self.caller}:{self.line} → {self.callee}"


class Package:
    """Every module's top-level functions and what its names import."""

    def __init__(self, root: Path) -> None:
        self.functions: dict[tuple[str, str], ast.FunctionDef] = {}
        self.imports: dict[str, dict[str, tuple[str, str]]] = {}
        for path in root.rglob("*.py"):
            parts = path.relative_to(root.parent).with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            tree = ast.parse(path.read_text(), str(path))
            names = self.imports.setdefault(module, {})
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    for alias in node.names:
                        names[alias.asname or alias.name] = (node.module, alias.name)
            for node in tree.body:
                if isinstance(node, ast.FunctionDef):
                    self.functions[(module, node.name)] = node
                    names.setdefault(node.name, (module, node.name))

    def resolve(self, module: str, call: ast.Call) -> tuple[str, str] | None:
        if not isinstance(call.func, ast.Name):
            return None
        target = self.imports.get(module, {}).get(call.func.id)
        seen = set()
        # a name re-exported by a package's __init__ resolves to its definition
        while target and target not in self.functions and target not in seen:
            seen.add(target)
            target = self.imports.get(target[0], {}).get(target[1])
        return target if target in self.functions else None


def _is_config(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in names
    return isinstance(node, ast.Attribute) and node.attr == "cfg"


def _in_order(fn: ast.FunctionDef) -> list[ast.AST]:
    nodes = [n for n in ast.walk(fn) if isinstance(n, (ast.Call, ast.Assign))]
    return sorted(nodes, key=lambda n: (n.lineno, n.col_offset))


def _params(fn: ast.FunctionDef) -> list[str]:
    return [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]


def climbs(package: Package, start=START) -> list[Site]:
    """The calls, reached from `start`, that hand the whole config on after the run was
    derived: every function the path calls is walked (a name bound to the config, as a
    parameter or read as `….cfg`, is followed)."""
    found: set[Site] = set()
    visited: set[tuple[str, str, frozenset[str], bool]] = set()

    def walk(module: str, name: str, held: frozenset[str], derived: bool) -> None:
        if (module, name, held, derived) in visited:
            return
        visited.add((module, name, held, derived))
        names = set(held)
        for node in _in_order(package.functions[(module, name)]):
            if isinstance(node, ast.Assign):
                if _is_config(node.value, names):
                    names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
                continue
            target = package.resolve(module, node)
            if target is None:
                continue
            params = _params(package.functions[target])
            handed = {
                params[i]
                for i, arg in enumerate(node.args)
                if i < len(params) and _is_config(arg, names)
            } | {kw.arg for kw in node.keywords if kw.arg and _is_config(kw.value, names)}
            if derived and handed:
                found.add(Site(f"{module}.{name}", node.lineno, ".".join(target)))
            walk(*target, frozenset(handed), derived)
            if target in DERIVES:
                derived = True

    module, name, param = start
    walk(module, name, frozenset({param}), derived=False)
    return sorted(found, key=str)


def test_the_config_is_not_handed_on_after_the_run_is_derived():
    sites = climbs(Package(PACKAGE))
    assert len(sites) <= MOST_CLIMBS, "\n".join(map(str, sites))


def test_the_walk_finds_a_config_handed_on_after_the_run_is_derived(tmp_path):
    """The check itself: a planted package whose path hands the config on after deriving, by
    name and read back through the spec, and once before (not a climb)."""
    root = tmp_path / "rayacc"
    (root / "driver").mkdir(parents=True)
    (root / "run").mkdir()
    for folder in (root, root / "driver", root / "run"):
        (folder / "__init__.py").write_text("")
    (root / "run" / "spec.py").write_text("def derive_run(cfg):\n    return cfg\n")
    (root / "driver" / "prelaunch.py").write_text(
        "from rayacc.run.spec import derive_run\n"
        "def check(cfg):\n    return cfg\n"
        "def prepare(cfg):\n    check(cfg)\n    return derive_run(cfg)\n"
    )
    (root / "driver" / "fit.py").write_text(
        "from rayacc.driver.prelaunch import check, prepare\n"
        "def later(spec):\n    c = spec.cfg\n    check(c)\n"
        "def fit(cfg):\n    spec = prepare(cfg)\n    check(cfg)\n    later(spec)\n"
    )
    sites = [str(s) for s in climbs(Package(root))]
    assert sites == [
        "rayacc.driver.fit.fit:7 → rayacc.driver.prelaunch.check",
        "rayacc.driver.fit.later:4 → rayacc.driver.prelaunch.check",
    ], sites
