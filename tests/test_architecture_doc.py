"""docs/architecture.md cannot drift from the code: its house diagram is the transitive reduction of
the packages' import graph, edge for edge, and every arrow of its two paths is an import of the
module graph (a dotted arrow: the callee imports the caller's package's interface instead)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_import_cycles import import_graph
from tests.test_layering import package_of, packages

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
NODE = re.compile(r'^\s*(\w+)\["([\w.]+)"\]\s*$')
EDGE = re.compile(r"^\s*(\w+)\s*(-->|-\.->)\s*(\w+)\s*$")


def diagrams() -> list[tuple[dict[str, str], list[tuple[str, str, str]]]]:
    """Each mermaid block: its node ids -> names, and its edges (from, arrow, to) by name."""
    found = []
    for block in re.findall(r"```mermaid\n(.*?)```", DOC.read_text(), re.S):
        names: dict[str, str] = {}
        edges = []
        for line in block.splitlines():
            if m := NODE.match(line):
                names[m[1]] = m[2]
            elif m := EDGE.match(line):
                edges.append((m[1], m[2], m[3]))
        found.append((names, [(names[a], arrow, names[b]) for a, arrow, b in edges]))
    return found


def package_graph() -> dict[str, set[str]]:
    rules = packages()
    graph: dict[str, set[str]] = {}
    for module, deps in import_graph().items():
        src = package_of(module, rules)
        if src == "dra_gpu":
            continue
        for dep in deps:
            dst = package_of(dep, rules)
            if dst not in (src, "dra_gpu"):
                graph.setdefault(src, set()).add(dst)
    return graph


def transitive_reduction(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    def reaches(start: str, target: str, skip: tuple[str, str]) -> bool:
        seen, todo = set(), [d for d in graph.get(start, ()) if (start, d) != skip]
        while todo:
            node = todo.pop()
            if node == target:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(graph.get(node, ()))
        return False

    return {(a, b) for a, deps in graph.items() for b in deps if not reaches(a, b, (a, b))}


def test_the_doc_has_its_three_diagrams() -> None:
    found = diagrams()
    assert len(found) == 3 and all(edges for _, edges in found)


def test_the_house_is_the_import_graph() -> None:
    names, edges = diagrams()[0]
    drawn = {(a, b) for a, arrow, b in edges if arrow == "-->"}
    assert drawn == transitive_reduction(package_graph())
    assert set(names.values()) == set(packages()) | {"dra_gpu.cli"}


def test_the_reduction_keeps_only_what_nothing_else_implies() -> None:
    assert transitive_reduction({"a": {"b", "c"}, "b": {"c"}}) == {("a", "b"), ("b", "c")}


def test_every_arrow_of_the_paths_is_an_import() -> None:
    graph = import_graph()
    wrong = []
    for _, edges in diagrams()[1:]:
        for a, arrow, b in edges:
            caller, callee = f"dra_gpu.{a}", f"dra_gpu.{b}"
            assert caller in graph and callee in graph, (a, b)
            if arrow == "-->":
                ok = callee in graph[caller]
            else:  # through an interface of the caller's package, which the callee imports
                package = caller.rpartition(".")[0]
                ok = callee not in graph[caller] and any(d.startswith(package + ".") for d in graph[callee])
            if not ok:
                wrong.append(f"{a} {arrow} {b}")
    assert wrong == []
