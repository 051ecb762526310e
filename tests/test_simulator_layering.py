"""The simulator stays in its package and the fake stays out of the product.

`dra_gpu.discovery` holds only what a real node runs, so it imports nothing of `dra_gpu.simnode`.
The Python fake NVML (`dra_gpu.simnode.fake*`) is for in-process tests and benchmarks: no module
of dra_gpu outside it imports it, the simulator's own product half (the C library's builder, the
simulated node, profiles, injection) included. Every import counts: top-level, inside functions and
under TYPE_CHECKING.
"""

from __future__ import annotations

from tests.test_import_cycles import import_graph

SIMNODE = "dra_gpu.simnode"
DISCOVERY = "dra_gpu.discovery"


def _is_fake(module: str) -> bool:
    return module.startswith(f"{SIMNODE}.fake")


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_graph_sees_the_simulator() -> None:
    graph = import_graph()
    assert "dra_gpu.simnode.fake_nvml_mig" in graph["dra_gpu.simnode.fake_nvml"]
    assert "dra_gpu.simnode.fake_nvml_events" in graph["dra_gpu.simnode.fake_nvml"]
    assert "dra_gpu.simnode.fake_nvml" in graph["dra_gpu.simnode.fake"]
    assert "dra_gpu.simnode.profiles" in graph["dra_gpu.simnode.builder"]
    assert "dra_gpu.discovery.nvml_discovery" in graph["dra_gpu.discovery"]


def test_only_the_fake_imports_the_fake() -> None:
    graph = import_graph()
    found = sorted(f"{m} -> {d}" for m, deps in graph.items() if not _is_fake(m) for d in deps if _is_fake(d))
    assert found == [], "the in-process fake NVML is for tests and benchmarks only"


# The probe's command line takes `--profile` as every node command does: it opens the node through
# the node backend and names the simulated node's error (inside its `main`, never on import).
NODE_COMMANDS = {"dra_gpu.discovery.nvml_probe -> dra_gpu.simnode.node"}


def test_discovery_imports_nothing_of_the_simulator() -> None:
    graph = import_graph()
    found = {
        f"{m} -> {d}" for m, deps in graph.items() if _under(m, DISCOVERY) for d in deps if _under(d, SIMNODE)
    }
    assert sorted(found - NODE_COMMANDS) == [], "dra_gpu.discovery holds what a real node runs"
