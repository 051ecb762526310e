"""The house's plan, enforced: each package's `__init__` docstring says whom it may import (a line
`May import: dra_gpu.common, dra_gpu.kube.`), and every import of every module keeps to it.

The rules are read from the docstrings, so what a newcomer reads is what is checked. Every import
counts: top-level, inside functions and under TYPE_CHECKING (tests.test_import_cycles.import_graph).
The rules themselves must order the packages (no two may import each other, directly or round a
loop), so an import allowed one way can never run back up. Only the command-line entry point and
`__init__` live at the root of `dra_gpu`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import simnode

import dra_gpu
from tests.test_import_cycles import _cycles, import_graph

DRA_GPU = Path(dra_gpu.__file__).parent
ENTRY_POINT = "dra_gpu.cli"  # the composition root of every command: it may import any package
RULE = re.compile(r"^May import: (?P<names>.*?)\.?\s*$\n?(?P<more>(?:^(?!\s*$).*\n?)*)", re.M)


def _rule(init: Path) -> frozenset[str]:
    doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
    m = RULE.search(doc)
    assert m, f"{init}: its docstring says whom the package may import ('May import: ...')"
    text = " ".join([m["names"], *m["more"].split()]).rstrip(".")
    if text.strip() == "nothing of dra_gpu":
        return frozenset()
    return frozenset(n.strip().rstrip(".") for n in text.split(",") if n.strip())


def packages() -> dict[str, frozenset[str]]:
    """Each package of the house (dra_gpu's sub-packages and the simulator) -> the packages it may
    import."""
    rules = {
        f"dra_gpu.{d.name}": _rule(d / "__init__.py")
        for d in sorted(DRA_GPU.iterdir())
        if (d / "__init__.py").is_file()
    }
    rules["simnode"] = _rule(Path(simnode.__file__))
    return rules


def package_of(module: str, rules: dict[str, frozenset[str]]) -> str:
    for pkg in rules:
        if module == pkg or module.startswith(pkg + "."):
            return pkg
    return module  # dra_gpu, dra_gpu.cli


def back_running(graph: dict[str, set[str]], rules: dict[str, frozenset[str]]) -> list[str]:
    """Every import from one package into another that its rule does not allow."""
    found = []
    for module, deps in graph.items():
        src = package_of(module, rules)
        for dep in deps:
            dst = package_of(dep, rules)
            if src == dst or (src == ENTRY_POINT and dst.startswith("dra_gpu")):
                continue
            if dst not in rules.get(src, frozenset()):
                found.append(f"{module} -> {dep}")
    return sorted(found)


def test_every_package_says_whom_it_may_import() -> None:
    rules = packages()
    assert {"dra_gpu.common", "dra_gpu.kube", "dra_gpu.model", "dra_gpu.node", "simnode"} <= rules.keys()
    for pkg, allowed in rules.items():
        unknown = allowed - rules.keys()
        assert not unknown, f"{pkg} may import {sorted(unknown)}, which is no package of the house"
    assert rules["dra_gpu.common"] == frozenset()


def test_the_rules_order_the_packages() -> None:
    rules = packages()
    loops = _cycles({pkg: set(allowed) for pkg, allowed in rules.items()})
    assert not loops, "packages allowed to import each other: " + "; ".join(" <-> ".join(c) for c in loops)


def test_no_import_runs_back_up() -> None:
    assert back_running(import_graph(), packages()) == []


def test_the_driver_never_imports_the_simulator() -> None:
    """The wheel and the image have no simulator: dra_gpu finds it only through the entry point."""
    graph = import_graph()
    found = [
        f"{m} -> {d}"
        for m, deps in graph.items()
        if m.startswith("dra_gpu")
        for d in deps
        if d.startswith("simnode")
    ]
    assert found == []


def test_a_back_running_import_is_found() -> None:
    """The check can fail: an import the rules do not allow, and one from the simulator's floor
    into the plugin, are both named."""
    rules = packages()
    graph = {
        "dra_gpu.discovery.nvml_discovery": {"dra_gpu.node.backend", "dra_gpu.model.inventory"},
        "simnode.node": {"dra_gpu.plugin.cdi"},
        "dra_gpu.cli": {"dra_gpu.plugin.server"},
    }
    assert back_running(graph, rules) == [
        "dra_gpu.discovery.nvml_discovery -> dra_gpu.node.backend",
        "simnode.node -> dra_gpu.plugin.cdi",
    ]


def test_only_the_entry_point_lives_at_the_root() -> None:
    loose = sorted(p.name for p in DRA_GPU.glob("*.py"))
    assert loose == ["__init__.py", "cli.py"]


def test_only_the_fake_imports_the_fake() -> None:
    """The in-process Python fake of NVML (`simnode.fake*`) is for unit tests and benchmarks: nothing
    else of the simulator imports it, and the driver nothing of the simulator at all."""
    graph = import_graph()
    assert "simnode.fake_nvml" in graph["simnode.fake"]  # the graph sees the fake

    def fake(m: str) -> bool:
        return m.startswith("simnode.fake")

    found = sorted(f"{m} -> {d}" for m, deps in graph.items() if not fake(m) for d in deps if fake(d))
    assert found == []
