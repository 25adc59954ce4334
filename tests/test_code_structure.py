"""The shape of the code, checked: no import circles between kvfleet's modules, and no oversized module.

The import graph is read with ``ast`` (nothing is imported): every ``import`` and ``from ... import`` anywhere
in a module counts, including those inside functions and under ``if TYPE_CHECKING:``. A lazy or type-only
import still ties the two modules' designs together, which is what a circle is about; hiding one inside a
function only moves the failure from import time to call time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Source roots of the distribution's packages (each holds kvfleet_* packages) and the benchmark scripts.
SOURCE_ROOTS = ("common", "engine", "gateway", "operator", "cli", "devkit")
MAX_MODULE_LINES = 600
# Modules allowed past the limit, each with the reason. Kernels are long by nature (one kernel, its launch
# wrapper and its reference stay together so they are read side by side).
LONG_MODULES_ALLOWED: dict[str, str] = {}


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of every kvfleet package."""
    found: dict[str, Path] = {}
    for root_name in SOURCE_ROOTS:
        root = ROOT / root_name
        if not root.is_dir():
            continue
        for path in sorted(root.glob("kvfleet_*/**/*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _imported_modules(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The kvfleet modules ``module`` imports: ``from a.b import c`` names ``a.b.c`` when that is a module.

    A submodule's implicit dependency on its parent packages is left out: a package ``__init__`` that imports
    its own submodules would otherwise make every package a circle.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                targets.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(module, path)
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            # `from pkg import mod` (a sibling module, the usual idiom) depends on pkg.mod, not on pkg's
            # __init__ (which runs first anyway, as for any submodule); a name defined in pkg depends on pkg.
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                targets.add(submodule if submodule in known else source)
    edges = set()
    for name in targets:
        # `import a.b.c` runs a, a.b and a.b.c; the circle that matters is with the module named, so take the
        # longest known prefix (a name imported from a module resolves to that module).
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            edges.add(name)
    return edges


def import_graph() -> dict[str, set[str]]:
    known = _modules()
    return {m: _imported_modules(m, p, known) for m, p in known.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components with more than one module (the import circles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    circles: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    return circles


def test_the_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert strongly_connected({"x": {"y"}, "y": set()}) == []


def test_the_import_reader_resolves_relative_and_from_imports(tmp_path):
    pkg = tmp_path / "kvfleet_x"
    (pkg / "sub").mkdir(parents=True)
    for name in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py"):
        (pkg / name).write_text("")
    (pkg / "sub" / "b.py").write_text(
        "from .. import a\nfrom kvfleet_x.sub import thing\ndef f():\n    import kvfleet_x.a\n"
    )
    (pkg / "a.py").write_text("from kvfleet_x import helper\n")
    known = {"kvfleet_x": pkg, "kvfleet_x.a": pkg / "a.py", "kvfleet_x.sub": pkg / "sub", "kvfleet_x.sub.b": None}
    edges = _imported_modules("kvfleet_x.sub.b", pkg / "sub" / "b.py", known)
    assert edges == {"kvfleet_x.a", "kvfleet_x.sub"}
    assert _imported_modules("kvfleet_x.a", pkg / "a.py", known) == {"kvfleet_x"}


def test_no_import_circles():
    graph = import_graph()
    assert len(graph) > 100, "the module walk found too few modules: is SOURCE_ROOTS right?"
    circles = strongly_connected(graph)
    assert not circles, "import circles (each list imports itself round):\n" + "\n".join(
        " -> ".join(c) for c in circles
    )


@pytest.mark.parametrize("root", [*SOURCE_ROOTS, "bench"])
def test_no_module_past_the_size_limit(root):
    base = ROOT / root
    if not base.is_dir():
        pytest.skip(f"{root}/ is not in this checkout")
    too_long = {}
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_MODULE_LINES and rel not in LONG_MODULES_ALLOWED:
            too_long[rel] = lines
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {too_long}"
