"""The driver's and the simulator's modules import each other without cycles.

A cycle works only in some import orders (whoever is imported first sees the other half-initialised),
which is why late imports used to hide them. Every import counts here: top-level, inside functions and
under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
from pathlib import Path

import simnode

import dra_gpu

# The driver, and the simulator built on it (its own distribution: imports run one way only).
PACKAGE_DIRS = (Path(dra_gpu.__file__).parent, Path(simnode.__file__).parent)


def _module_name(path: Path, package_dir: Path) -> str:
    parts = path.relative_to(package_dir.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p, d): p for d in PACKAGE_DIRS for p in sorted(d.rglob("*.py"))}


def _imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports: `import x`, `from x import y` (x, or x.y if that is a
    module), relative forms included."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            submodules = {f"{source}.{a.name}" for a in node.names} & modules.keys()
            names_only = [a for a in node.names if f"{source}.{a.name}" not in modules]
            out.update(submodules)
            if names_only or not submodules:
                out.add(source)
    return {m for m in out if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(name, path, modules) for name, path in modules.items()}


def test_graph_sees_the_package() -> None:
    graph = import_graph()
    assert "dra_gpu.controller.rules" in graph
    assert "dra_gpu.controller.allocator_view" in graph["dra_gpu.controller.rules"]
    assert "dra_gpu.node.slices" in graph["dra_gpu.cli"]


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = _cycles(graph)
    assert not cycles, "import cycles among dra_gpu's modules: " + "; ".join(" <-> ".join(c) for c in cycles)
