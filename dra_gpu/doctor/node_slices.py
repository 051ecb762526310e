"""Does every GPU node publish its slices: each node the driver's label selects has a complete pool
of the current generation, and no slice is left for a node that is gone."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from dra_gpu.doctor.cluster_view import ClusterView, object_meta, object_name, object_spec
from dra_gpu.doctor.report import Result, fail, ok, warn
from dra_gpu.doctor.settings import ClusterSettings


def selector_matches(selector: str, labels: Mapping[str, str]) -> bool:
    """Equality-based label selector: "a=b,c!=d,e,!f"."""
    for term in (t.strip() for t in selector.split(",")):
        if not term:
            continue
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k.strip()) == v.strip():
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if labels.get(k.strip()) != v.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def check_node_slices(view: ClusterView, settings: ClusterSettings) -> Iterable[Result]:
    """Every node labelled for the driver publishes a complete pool of the current generation."""
    driver = settings.driver
    by_node: dict[str, list[dict[str, Any]]] = {}
    for s in view.slices_of(driver):
        by_node.setdefault(str(object_spec(s).get("nodeName") or ""), []).append(s)
    labelled = sorted(
        object_name(n)
        for n in view.nodes
        if selector_matches(settings.node_selector, object_meta(n).get("labels") or {})
    )
    if not labelled:
        yield warn(
            "cluster/gpu-nodes",
            f"no node is labelled {settings.node_selector}: the chart's DaemonSet runs nowhere"
            + (f" (slices from {', '.join(sorted(n for n in by_node if n))})" if by_node else ""),
            f"label the GPU nodes: kubectl label node NODE {settings.node_selector} "
            "(or run NVIDIA GPU feature discovery)",
        )
    for node in labelled:
        name = f"cluster/slices/{node}"
        slices = by_node.get(node, [])
        if not slices:
            yield fail(
                name,
                f"labelled {settings.node_selector} but no ResourceSlice of {driver}: the plugin is "
                "not running there or cannot reach the API server",
                f"check the plugin pod on {node} (`kubectl get pods -A -o wide --field-selector "
                f"spec.nodeName={node}`), then run `dra-gpu doctor` on the node",
            )
            continue
        yield _pool_result(name, slices)
    known = {object_name(n) for n in view.nodes}
    for node in sorted(n for n in by_node if n and n not in known):
        yield warn(
            f"cluster/slices/{node}",
            f"{len(by_node[node])} slices of {driver} for node {node}, which does not exist",
            f"kubectl delete resourceslices --field-selector spec.nodeName={node}",
        )


def _pool_result(name: str, slices: list[dict[str, Any]]) -> Result:
    pools: dict[str, list[Mapping[str, Any]]] = {}
    for s in slices:
        pool = object_spec(s).get("pool") or {}
        pools.setdefault(str(pool.get("name", "")), []).append(s)
    parts, problems = [], []
    for pool_name, items in sorted(pools.items()):
        gens = [int((object_spec(s).get("pool") or {}).get("generation", 0)) for s in items]
        top = max(gens)
        current = [s for s, g in zip(items, gens, strict=True) if g == top]
        want = int((object_spec(current[0]).get("pool") or {}).get("resourceSliceCount", 1))
        devices = sum(len(object_spec(s).get("devices") or []) for s in current)
        parts.append(f"pool {pool_name}: generation {top}, {len(current)}/{want} slices, {devices} devices")
        if len(current) != want:
            problems.append(f"pool {pool_name} generation {top} has {len(current)} of {want} slices")
        if len(current) != len(items):
            problems.append(f"pool {pool_name} has {len(items) - len(current)} slices of older generations")
    if problems:
        return warn(
            name,
            "; ".join(parts + problems) + " (the scheduler ignores an incomplete pool)",
            "wait a few seconds (an update in progress); if it stays, restart the plugin on the node",
        )
    return ok(name, "; ".join(parts))
