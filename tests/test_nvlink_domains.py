"""NVLink domains are derived from link data, per profile and on hand-made topologies."""

from __future__ import annotations

import pytest
from conftest import bus, discover_doc, gpu_uuid
from simnode.fake import discover_node

from dra_gpu.discovery.nvlink_domains import domain_id


def domain_sets(profile: str) -> set[frozenset[int]]:
    inv = discover_node("node-a", profile)
    return {frozenset(g.index for g in members) for members in inv.domains().values()}


@pytest.mark.parametrize(
    ("profile", "expected"),
    [
        ("hgx-2x4", [{0, 1, 2, 3}, {4, 5, 6, 7}]),
        ("dgx-h100", [set(range(8))]),
        ("pcie-pairs", [{0, 1}, {2, 3}]),
        ("mixed", [{0}, {1}, {2}, {3}]),
        # GPUs 0-2 are in MIG mode: not whole GPUs, so not in any domain.
        ("dgx-a100-mig", [{3, 4, 5, 6, 7}]),
    ],
)
def test_profile_domains(profile: str, expected: list[set[int]]) -> None:
    assert domain_sets(profile) == {frozenset(s) for s in expected}


def test_domain_attributes_are_consistent() -> None:
    inv = discover_node("node-a", "hgx-2x4")
    for members in inv.domains().values():
        assert {g.nvlink_domain_size for g in members} == {len(members)}
    ids = list(inv.domains())
    assert len(ids) == len(set(ids)) == 2


def test_domain_ids_differ_between_nodes() -> None:
    a = set(discover_node("node-a", "dgx-h100").domains())
    b = set(discover_node("node-b", "dgx-h100").domains())
    assert a and b and not a & b


def test_domain_ids_are_stable_across_runs() -> None:
    assert discover_node("n", "hgx-2x4").domains().keys() == discover_node("n", "hgx-2x4").domains().keys()


def cube_mesh_doc(base_doc: dict, order: list[int]) -> dict:
    """DGX-1 hybrid cube-mesh: {0-3} and {4-7} fully linked, plus i <-> i+4."""
    peers = {i: ({0, 1, 2, 3} if i < 4 else {4, 5, 6, 7}) - {i} | {(i + 4) % 8} for i in range(8)}
    base_doc["gpus"] = [
        {
            "index": pos,
            "minor": i,
            "uuid": gpu_uuid(i),
            "pciBusId": bus(i),
            "nvlinks": [{"remote": bus(p), "links": 1} for p in sorted(peers[i])],
        }
        for pos, i in enumerate(order)
    ]
    return base_doc


def test_hybrid_cube_mesh_picks_largest_lowest_cliques(base_doc: dict) -> None:
    inv = discover_doc(cube_mesh_doc(base_doc, list(range(8))))
    groups = {frozenset(g.minor for g in m) for m in inv.domains().values()}
    assert groups == {frozenset({0, 1, 2, 3}), frozenset({4, 5, 6, 7})}


def test_hybrid_cube_mesh_rule_ignores_enumeration_order(base_doc: dict) -> None:
    # Same machine, NVML enumerating the GPUs in another order: same partition by PCI address.
    inv = discover_doc(cube_mesh_doc(base_doc, [5, 2, 7, 0, 3, 6, 1, 4]))
    groups = {frozenset(g.minor for g in m) for m in inv.domains().values()}
    assert groups == {frozenset({0, 1, 2, 3}), frozenset({4, 5, 6, 7})}


def test_partial_connectivity_is_not_a_domain(base_doc: dict) -> None:
    # A chain 0-1-2: 0 and 2 are not connected, so they cannot share a domain.
    base_doc["gpus"][0]["nvlinks"] = [{"remote": bus(1), "links": 4}]
    base_doc["gpus"][1]["nvlinks"] = [{"remote": bus(0), "links": 4}, {"remote": bus(2), "links": 4}]
    base_doc["gpus"][2]["nvlinks"] = [{"remote": bus(1), "links": 4}]
    inv = discover_doc(base_doc)
    groups = sorted(sorted(g.index for g in m) for m in inv.domains().values())
    assert groups == [[0, 1], [2], [3]]


def test_fabric_clique_gives_cluster_wide_domain(base_doc: dict) -> None:
    cluster = "7f3c2a10-5b6e-4d8f-9a0b-1c2d3e4f5a6b"
    for g in base_doc["gpus"][:2]:
        g["fabric"] = {"clusterUuid": cluster, "cliqueId": 32766}
    inv = discover_doc(base_doc)
    fabric = [g for g in inv.gpus if g.index < 2]
    assert {g.nvlink_domain for g in fabric} == {f"{cluster}.32766"}
    assert {g.nvlink_domain_size for g in fabric} == {2}
    assert all(g.nvlink_domain != f"{cluster}.32766" for g in inv.gpus[2:])


def test_incomplete_fabric_registration_is_ignored(base_doc: dict) -> None:
    base_doc["gpus"][0]["fabric"] = {
        "clusterUuid": "7f3c2a10-5b6e-4d8f-9a0b-1c2d3e4f5a6b",
        "cliqueId": 1,
        "state": 2,
    }  # IN_PROGRESS
    inv = discover_doc(base_doc)
    assert inv.gpus[0].fabric is None
    assert inv.gpus[0].nvlink_domain == "node-a.0000-10-00-0"


def test_long_node_names_keep_domain_ids_short_and_distinct() -> None:
    a = domain_id("a" * 200 + "-1", "0000:18:00.0")
    b = domain_id("a" * 200 + "-2", "0000:18:00.0")
    assert len(a) <= 64 and len(b) <= 64 and a != b


def test_clique_search_is_capped_on_adversarial_graphs() -> None:
    """The complement of disjoint triangles has 3^(n/3) maximal cliques (3^85 for 255 GPUs): the
    capped search still partitions it into cliques, in well under a second."""
    import time

    from dra_gpu.discovery.nvlink_domains import partition

    nodes = [f"{i:04d}" for i in range(255)]
    adj = {a: {b for b in nodes if b != a and int(a) // 3 != int(b) // 3} for a in nodes}
    start = time.monotonic()
    groups = partition(adj)
    assert time.monotonic() - start < 5
    assert sorted(v for g in groups for v in g) == nodes
    for g in groups:  # every group is a clique
        assert all(b in adj[a] for a in g for b in g if a != b)
