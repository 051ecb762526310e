"""The devices the allocator sees on a node: its own slices' and those published for all nodes."""

from __future__ import annotations

from typing import Any

from dra_gpu.controller.allocator_view import Cluster
from dra_gpu.controller.cel import CelEnvironment, Schema

from .objects import DRIVER, GPU_CLASS


def _slice(pool: str, devices: list[str], node: str | None = None, driver: str = DRIVER) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "driver": driver,
        "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1},
        "devices": [{"name": d} for d in devices],
    }
    spec.update({"nodeName": node} if node else {"allNodes": True})
    return {"metadata": {"name": f"{pool}-slice"}, "spec": spec}


def test_a_node_sees_its_own_pools_and_those_for_all_nodes_in_pool_order() -> None:
    slices = [
        _slice("node-b", ["b0"], "node-b"),
        _slice("everywhere", ["e0", "e1"]),
        _slice("node-a", ["a0", "a1"], "node-a"),
        _slice("a-other-driver", ["x0"], "node-a", driver="other.example.com"),
    ]
    cluster = Cluster(CelEnvironment(Schema.default(DRIVER)), slices, {"gpu.dra-gpu.io": GPU_CLASS})
    names = {node: [d.name for d in cluster.devices(node)] for node in ("node-a", "node-b", "node-c")}
    # Pools in (driver, name) order: the driver's everywhere, node-a, node-b, then the other driver's.
    assert names == {
        "node-a": ["e0", "e1", "a0", "a1", "x0"],
        "node-b": ["e0", "e1", "b0"],
        "node-c": ["e0", "e1"],
    }
    assert cluster.nodes == ["node-a", "node-b"]
    assert [d.name for d in cluster.devices("")] == ["e0", "e1", "a0", "a1", "b0", "x0"]
