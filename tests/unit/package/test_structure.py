"""The shape of the package, as docs/design.md states it: the worker loop a conductor, and the
workers acting on the run as the driver derived it (RunSpec) rather than reaching back into
the config."""

from __future__ import annotations

import ast
from pathlib import Path

import rayacc

ROOT = Path(rayacc.__file__).parent
LOOP_MAX_LINES = 300
MAX_CONFIG_READS = 8
"""Functions on the worker's side that take the whole config or read `.cfg`: the build of a
rank's model and strategy (models/) needs the model's and strategy's sections; everything else
comes from `RunSpec` (its quantities and `WorkerSettings`)."""
WING_BINDING = {"from_config", "read_user_config", "describe"}
"""A strategy wing's binding of its own config section (engine/parallel/): read by design, as
the config layer is."""


SHARED_NAMES = {
    "common": "what a unit's modules share",
    "errors": "a unit's one error",
    "jobs": "`rayacc submit`/`jobs`: the driver's call and the command",
    "runs": "a storage path's runs: where a run lives, and `rayacc runs`",
    "sweep": "a sweep: its schema, its run, its command",
}
"""File names more than one unit holds, each with its one meaning (a concept's layers)."""


def test_a_file_name_means_one_thing():
    by_name: dict[str, list[str]] = {}
    for p in ROOT.rglob("*.py"):
        if p.name != "__init__.py":
            by_name.setdefault(p.stem, []).append(str(p.relative_to(ROOT)))
    repeated = {n: sorted(ps) for n, ps in by_name.items() if len(ps) > 1}
    unexplained = {n: ps for n, ps in repeated.items() if n not in SHARED_NAMES}
    assert not unexplained, (
        f"one file name, several units: {unexplained}; name each for what it holds, or say in "
        "SHARED_NAMES the one meaning they share"
    )


README_MAX_LINES = 450
DOCSTRING_MAX_LINES = 12
"""A docstring says why in a few lines; measurements and long explanations go to docs/ and
bench/results/ (a config field's docstring, the fix its errors print, is no function's)."""


def test_the_readme_reads_in_one_sitting():
    lines = len((ROOT.parent / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md: {lines} lines (details go to docs/guide.md)"


def test_no_docstring_is_longer_than_a_few_lines():
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
            doc = ast.get_docstring(node, clean=False) if isinstance(node, kinds) else None
            if doc and len(doc.splitlines()) > DOCSTRING_MAX_LINES:
                name = getattr(node, "name", "(module)")
                long.append(f"{path.relative_to(ROOT)}:{name} {len(doc.splitlines())}")
    assert not long, f"over {DOCSTRING_MAX_LINES} lines (move the details to docs/): {long}"


def test_the_train_loop_conducts():
    lines = len((ROOT / "worker" / "loop.py").read_text().splitlines())
    assert lines <= LOOP_MAX_LINES, f"worker/loop.py: {lines} lines"


def _module_path(name: str) -> Path | None:
    path = ROOT.parent.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _rayacc_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rayacc"):
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("rayacc"))
    return {n for n in names if _module_path(n)}


def worker_config_reads() -> list[str]:
    """Every function in a module the worker loop reaches (by imports) that takes `cfg` or
    reads an attribute `.cfg`; the config layer and the derivation (quantities.py) are where
    the config is read by design."""
    seen: set[str] = set()
    todo = ["rayacc.worker.loop"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += _rayacc_imports(_module_path(name))
    found = []
    for name in sorted(seen):
        if name.startswith(("rayacc.config", "rayacc.run")):
            continue
        for node in ast.walk(ast.parse(_module_path(name).read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if name.startswith("rayacc.engine.parallel") and node.name in WING_BINDING:
                continue
            params = {a.arg for a in node.args.args + node.args.kwonlyargs}
            reads = any(isinstance(n, ast.Attribute) and n.attr == "cfg" for n in ast.walk(node))
            if "cfg" in params or reads:
                found.append(f"{name}.{node.name}")
    return found


def test_the_workers_act_on_the_run_as_derived():
    found = worker_config_reads()
    assert 0 < len(found) <= MAX_CONFIG_READS, found
    assert not [f for f in found if f.startswith("rayacc.worker.loop")], found


def test_the_count_sees_a_read_added_to_the_loop(monkeypatch, tmp_path):
    """The count above is not blind: a worker module that reads `self.cfg` is found."""
    text = (ROOT / "worker" / "cadence.py").read_text()
    planted = text + "\n\ndef _planted(self):\n    return self.cfg.train\n"
    original = Path.read_text

    def read_text(self, *args, **kwargs):
        if self == ROOT / "worker" / "cadence.py":
            return planted
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    assert "rayacc.worker.cadence._planted" in worker_config_reads()


def _module_imports() -> dict[str, set[str]]:
    """Every rayacc module → the rayacc modules it imports anywhere in it (inside functions and
    under TYPE_CHECKING too: a circle drawn lazily is still a circle)."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                candidates = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            found.update(c for c in candidates if c.startswith("rayacc.") and _module_path(c))
        graph[name] = found - {name}
    return graph


def test_no_circle_of_imports_between_modules():
    """A package's `__init__` re-exporting its modules is no circle: the edges into an
    `__init__` from its own package's modules are the exception."""
    graph = _module_imports()
    for name, deps in graph.items():
        graph[name] = {d for d in deps if not (d in graph and name.startswith(d + "."))}
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles, circles


MESH_ROOM = {"config/mesh.py": "the degrees, read once", "config/parallel.py": "their rules"}
"""Where the mesh's degrees are read from the config and their keys named; the schema declares
the fields (by their names in `train`, never the dotted keys) and each degree's wing
(engine/parallel/) takes them from a `Mesh`."""


def test_a_degree_of_the_mesh_is_read_and_named_in_the_mesh_room_alone():
    """Every key `Mesh.KEYS` lists (tomorrow's degree included), as a dotted key or an
    attribute read of the `train` section, appears in the mesh room only: any other module
    asks a `Mesh` (`cfg.mesh`, `Mesh.of_sections`) for the degree and `Mesh.key` for its
    name."""
    import re

    from rayacc.config.mesh import Mesh

    fields = "|".join(re.escape(k.split(".", 1)[1]) for k in Mesh.KEYS.values())
    pattern = re.compile(rf"\btrain\.({fields})\b")
    seen = {
        f"{p.relative_to(ROOT)}:{n}": m.group(0)
        for p in ROOT.rglob("*.py")
        if str(p.relative_to(ROOT)) not in MESH_ROOM
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if (m := pattern.search(line))
    }
    assert not seen, f"a degree read or named outside the mesh room: {seen}"
    assert len(Mesh.KEYS) >= 4, "the room's own list is what this test reads"
