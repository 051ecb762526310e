"""NVLink domains, derived from the NVLink link data (never from a label).

Two GPUs are *connected* when one has an active link whose remote end is the other, or when both
have active links to the same NVSwitch. A domain is a set of GPUs in which every pair is connected,
so `matchAttribute: nvlinkDomain` over N devices means "N GPUs that can all talk over NVLink".

Where maximal cliques overlap (the hybrid cube-mesh of DGX-1 class machines, where {0-3}, {4-7} and
{0,1,4,5} are all cliques), the partition is chosen greedily and deterministically: take the
largest clique; among equally large ones, the one whose sorted PCI bus ids come first; remove its
GPUs and repeat. A GPU left alone is a domain of one.

GPUs that report a completed multi-node NVLink fabric registration get the cluster-wide domain
`<clusterUUID>.<cliqueId>` instead. Other domain ids are `<node>.<first GPU's PCI address>`,
unique cluster-wide because node names are, and stable because PCI addresses are.

GPUs in MIG mode are not published as whole GPUs and take no part in domains.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable

from dra_gpu.model.inventory import Gpu, Inventory

MAX_ATTRIBUTE_STRING = 64


def connectivity(gpus: Iterable[Gpu], other_gpus: Iterable[str] = ()) -> dict[str, set[str]]:
    """PCI bus id -> bus ids of the GPUs it is NVLink-connected to.

    `other_gpus` are bus ids of GPUs that take no part (MIG mode): links to them are not switches.
    """
    gpus = list(gpus)
    bus_ids = {g.pci_bus_id for g in gpus}
    not_switches = bus_ids | set(other_gpus)
    adj: dict[str, set[str]] = {g.pci_bus_id: set() for g in gpus}
    switches: dict[str, set[str]] = {}
    for g in gpus:
        for link in g.nvlinks:
            remote = link.remote_pci_bus_id
            if remote in bus_ids and remote != g.pci_bus_id:
                adj[g.pci_bus_id].add(remote)
                adj[remote].add(g.pci_bus_id)
            elif remote not in not_switches and not link.remote_is_gpu:
                switches.setdefault(remote, set()).add(g.pci_bus_id)
    for members in switches.values():
        for a in members:
            adj[a] |= members - {a}
    return adj


MAX_CLIQUE_STEPS = 5_000


def maximal_cliques(adj: dict[str, set[str]], max_steps: int = MAX_CLIQUE_STEPS) -> list[frozenset[str]]:
    """Bron-Kerbosch with pivoting, capped at `max_steps` expansions.

    Real nodes (<= a few dozen GPUs, cliques that do not overlap much) finish in far fewer steps;
    a link graph built to have exponentially many maximal cliques stops at the cap with the cliques
    found so far (at least one: the first descent reaches a leaf within len(adj) steps), so a
    profile can never make discovery run for hours. Deterministic, as the order is.
    """
    out: list[frozenset[str]] = []
    steps = 0

    class _Capped(Exception):
        pass

    def expand(r: set[str], p: set[str], x: set[str]) -> None:
        nonlocal steps
        steps += 1
        if steps > max_steps and out:
            raise _Capped
        if not p and not x:
            out.append(frozenset(r))
            return
        pivot = max(sorted(p | x), key=lambda v: len(adj[v] & p))
        for v in sorted(p - adj[pivot]):
            expand(r | {v}, p & adj[v], x & adj[v])
            p = p - {v}
            x = x | {v}

    with contextlib.suppress(_Capped):
        expand(set(), set(adj), set())
    return out


def partition(adj: dict[str, set[str]]) -> list[list[str]]:
    """Greedy, deterministic partition of the GPUs into cliques (see the module doc)."""
    remaining = set(adj)
    groups = []
    while remaining:
        sub = {v: adj[v] & remaining for v in remaining}
        best = min(maximal_cliques(sub), key=lambda c: (-len(c), sorted(c)))
        groups.append(sorted(best))
        remaining -= best
    return sorted(groups)


def domain_id(node_name: str, first_bus_id: str) -> str:
    """`<node>.<bus>`, shortened with a hash of the node name when it would pass 64 chars."""
    bus = first_bus_id.replace(":", "-").replace(".", "-")
    full = f"{node_name}.{bus}"
    if len(full) <= MAX_ATTRIBUTE_STRING:
        return full
    digest = hashlib.sha256(node_name.encode()).hexdigest()[:8]
    keep = MAX_ATTRIBUTE_STRING - len(bus) - len(digest) - 2
    return f"{node_name[:keep].rstrip('.-')}-{digest}.{bus}"


def assign_domains(inv: Inventory) -> None:
    """Set `nvlink_domain` and `nvlink_domain_size` on every whole (non-MIG) GPU."""
    whole = [g for g in inv.gpus if not g.mig_enabled]
    by_bus = {g.pci_bus_id: g for g in whole}
    fabric_groups: dict[str, list[Gpu]] = {}
    for g in whole:
        if g.fabric is not None:
            key = f"{g.fabric.cluster_uuid}.{g.fabric.clique_id}"
            fabric_groups.setdefault(key, []).append(g)
    for key, members in fabric_groups.items():
        for g in members:
            g.nvlink_domain, g.nvlink_domain_size = key, len(members)
    local = [g for g in whole if g.fabric is None]
    others = [g.pci_bus_id for g in inv.gpus if g.mig_enabled]
    for group in partition(connectivity(local, others)):
        did = domain_id(inv.node_name, group[0])
        for bus in group:
            by_bus[bus].nvlink_domain, by_bus[bus].nvlink_domain_size = did, len(group)
