"""Why a claim cannot be placed, said with the best the cluster offers.

"request 'gpus': no GPU with memory >= 100Gi; largest: 80Gi", "largest NVLink domain: 8 GPUs
(node-a); the claim needs 16 NVLink-connected GPUs", ...
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from dra_gpu.controller.allocation_errors import UnknownClassError
from dra_gpu.controller.allocator import place
from dra_gpu.controller.allocator_view import Cluster
from dra_gpu.controller.claim_requests import Constraint, Request, SubRequest, parse_requests
from dra_gpu.controller.published_devices import Device, blocking_taint, describe_taint
from dra_gpu.kube.values import format_quantity

_CAP_COMPARE = re.compile(
    r"capacity\s*\[\s*[\"']([^\"']+)[\"']\s*\]\s*\.\s*(\w+)\s*\.\s*"
    r"(?:compareTo\s*\(\s*quantity\s*\(\s*[\"']([^\"']+)[\"']\s*\)\s*\)\s*(>=|>|==)\s*0"
    r"|(isGreaterThan)\s*\(\s*quantity\s*\(\s*[\"']([^\"']+)[\"']\s*\)\s*\))"
)
_CAP_REF = re.compile(r"capacity\s*\[\s*[\"']([^\"']+)[\"']\s*\]\s*\.\s*(\w+)")


def _noun(devices: list[Device], plural: bool = False) -> str:
    kinds = {(d.attribute(f"{d.driver}/type") or ("", ""))[1] for d in devices}
    noun = {"gpu": "GPU", "mig": "MIG device"}.get(kinds.pop(), "device") if len(kinds) == 1 else "device"
    return noun + "s" if plural else noun


def _selector_problem(cluster: Cluster, sub: SubRequest, pool: list[Device]) -> str:
    """Why no device of the class matches the request's selectors."""
    for i, expr in enumerate(sub.selectors):
        if any(cluster.matches(expr, d) for d in pool):
            continue
        m = _CAP_COMPARE.search(expr)
        if m:
            name = m.group(2)
            op = m.group(4) or ">"
            want = m.group(3) or m.group(6)
            sizes = [c for c in (d.capacity(name) for d in pool) if c is not None]
            largest = f"; largest: {format_quantity(max(sizes))}" if sizes else ""
            return f"no {_noun(pool)} with {name} {op} {want}{largest}"
        ref = _CAP_REF.search(expr)
        extra = ""
        if ref:
            sizes = [c for c in (d.capacity(ref.group(2)) for d in pool) if c is not None]
            if sizes:
                extra = f"; largest {ref.group(2)}: {format_quantity(max(sizes))}"
        return f"selectors[{i}] matches none of the {len(pool)} devices of class {sub.device_class!r}{extra}"
    for i, expr in enumerate(sub.selectors):
        m = _CAP_COMPARE.search(expr)
        if not m:
            continue
        others = [
            d for d in pool if all(cluster.matches(e, d) for j, e in enumerate(sub.selectors) if j != i)
        ]
        if not others or any(cluster.matches(expr, d) for d in others):
            continue
        name, op, want = m.group(2), m.group(4) or ">", m.group(3) or m.group(6)
        sizes = [c for c in (d.capacity(name) for d in others) if c is not None]
        largest = f"; largest: {format_quantity(max(sizes))}" if sizes else ""
        profiles = sorted({str(v[1]) for d in others if (v := d.attribute(f"{d.driver}/profile"))})
        which = f" ({', '.join(profiles)})" if profiles else ""
        return (
            f"none of the {len(others)} {_noun(others, True)}{which} its other selectors pick has "
            f"{name} {op} {want}{largest}"
        )
    return f"no device matches all selectors together (class {sub.device_class!r} has {len(pool)} devices)"


def _alternative_reason(cluster: Cluster, sub: SubRequest, ignore_in_use: bool) -> tuple[int, str]:
    """(most devices on one node, reason) for one request alternative; reason empty when counts fit."""
    best_n, best_node = -1, ""
    per_class: list[Device] = []
    blocked: list[tuple[str, Device, str]] = []  # (node, device, taint) the request does not tolerate
    selected: list[Device] = []  # match the class and the request's selectors
    capable: list[Device] = []  # ... and could ever give the requested capacity
    cls = cluster.classes.get(sub.device_class)
    if cls is None:
        raise UnknownClassError(sub.device_class)
    class_sel = [
        str((s.get("cel") or {}).get("expression", ""))
        for s in (cls.get("spec") or {}).get("selectors") or []
    ]
    for node in cluster.nodes:
        devs = cluster.devices(node)
        in_class = [d for d in devs if all(cluster.matches(e, d) for e in class_sel)]
        per_class += in_class
        ok = [d for d in in_class if all(cluster.matches(e, d) for e in sub.selectors)]
        selected += ok
        if sub.capacity:
            ok = [d for d in ok if d.consumption(sub.capacity) is not None]
            capable += ok
        if not ignore_in_use:
            ok = [d for d in ok if d.key not in cluster.in_use or sub.admin_access]
            for d in ok:
                taint = blocking_taint(d, sub)
                if taint is not None:
                    blocked.append((node, d, describe_taint(taint)))
            ok = [d for d in ok if blocking_taint(d, sub) is None]
            ok = [d for d in ok if _fits_now(cluster, sub, d)]
        if len(ok) > best_n:
            best_n, best_node = len(ok), node
    taints = _taint_note(blocked)
    if sub.mode == "All":
        return (
            best_n,
            "" if best_n > 0 else f"request {sub.name!r}: no device matches (allocationMode All){taints}",
        )
    if best_n >= sub.count:
        return best_n, ""
    if not per_class:
        return best_n, f"request {sub.name!r}: no published device belongs to class {sub.device_class!r}"
    if best_n <= 0 and selected and sub.capacity:
        return best_n, f"request {sub.name!r}: {_capacity_problem(cluster, sub, selected, capable)}"
    if best_n <= 0 and not blocked:
        return best_n, f"request {sub.name!r}: {_selector_problem(cluster, sub, per_class)}"
    where = f" ({best_node})" if best_node else ""
    return best_n, (
        f"request {sub.name!r} needs {sub.count} {_noun(per_class, True)}; "
        f"at most {max(best_n, 0)} match on one node{where}{taints}"
    )


def _taint_note(blocked: list[tuple[str, Device, str]], limit: int = 4) -> str:
    """ "; tainted, not tolerated: node/device key=value:Effect, ..." (empty when nothing is)."""
    if not blocked:
        return ""
    shown = ", ".join(f"{node + '/' if node else ''}{d.name} {t}" for node, d, t in blocked[:limit])
    more = f" and {len(blocked) - limit} more" if len(blocked) > limit else ""
    return f"; tainted, not tolerated: {shown}{more}"


def _fits_now(cluster: Cluster, sub: SubRequest, d: Device) -> bool:
    """A shared device still has what this request would consume."""
    if not d.multi:
        return True
    cons = d.consumption(sub.capacity)
    return cons is not None and all(amount <= (cluster.free(d, name) or 0) for name, amount in cons.items())


def _asked(sub: SubRequest) -> str:
    return ", ".join(f"{name} {format_quantity(v)}" for name, v in sorted(sub.capacity.items()))


def _capacity_problem(
    cluster: Cluster, sub: SubRequest, selected: list[Device], capable: list[Device]
) -> str:
    """'no GPU can ever give memory 90Gi (largest: 80Gi)' or 'no GPU has memory 48Gi free right now'."""
    noun = _noun(selected)
    if not capable:
        sizes = []
        for name in sub.capacity:
            values = [v for v in (d.capacity(name) for d in selected) if v is not None]
            if values:
                sizes.append(f"{name} {format_quantity(max(values))}")
        largest = f" (largest: {', '.join(sizes)})" if sizes else ""
        return f"no {noun} can ever give {_asked(sub)}{largest}"
    free = []
    for name in sub.capacity:
        values = [v for v in (cluster.free(d, name) for d in capable) if v is not None]
        if values:
            free.append(f"{name} {format_quantity(max(values))}")
    most = f" (most free: {', '.join(free)})" if free else ""
    return f"no {noun} has {_asked(sub)} free right now{most}"


def why_not(cluster: Cluster, spec: Mapping[str, Any], ignore_in_use: bool = False) -> str:
    """Why the search found no placement. Raises AllocationError when the diagnosis meets what the
    search stopped before (a later request's class that does not exist, a selector failing there)."""
    requests, constraints = parse_requests(spec)
    if not cluster.pools:
        return "no ResourceSlices are published"
    count_reasons: list[str] = []
    for req in requests:
        found = [_alternative_reason(cluster, sub, ignore_in_use) for sub in req.alternatives]
        reasons = [r for _, r in found]
        if all(reasons):
            if all(n <= 0 for n, _ in found):  # nothing matches at all: that is the reason
                return "; ".join(reasons)
            count_reasons.append("; ".join(reasons))
    constraint_reasons = _constraint_reasons(cluster, requests, constraints, ignore_in_use)
    if constraint_reasons or count_reasons:
        return "; ".join(constraint_reasons + count_reasons)
    counters = _counter_reason(cluster, spec, ignore_in_use)
    if counters:
        return counters
    nodes = ", ".join(n for n in cluster.nodes if n) or "any node"
    if not ignore_in_use and cluster.busy:
        return f"no free combination of devices satisfies the requests and constraints on {nodes}"
    return f"no combination of devices satisfies all requests and constraints together on {nodes}"


def _counter_reason(cluster: Cluster, spec: Mapping[str, Any], ignore_in_use: bool) -> str:
    """When the devices would fit but for the counters they share (MIG placements overlapping on
    one GPU), name a counter the first such choice overruns."""
    for node in cluster.nodes:
        free = place(cluster, spec, node, ignore_in_use, ignore_counters=True)
        if free is None:
            continue
        taken = {} if ignore_in_use else cluster.consumed_by_in_use(node)
        used: dict[tuple[tuple[str, str], str, str], Decimal] = dict(taken)
        users: dict[tuple[tuple[str, str], str, str], list[str]] = {}
        for _, d in free.results:
            for cset, counters in d.consumes:
                for cname, v in counters.items():
                    k = (d.pool_key, cset, cname)
                    used[k] = used.get(k, Decimal(0)) + v
                    users.setdefault(k, []).append(d.name)
        over = []
        for k, total in used.items():
            pool = cluster.pool(k[0])
            have = pool.counters.get((k[1], k[2])) if pool is not None else None
            if have is not None and total > have:
                over.append((k, total, have))
        # A placement overlap says the most: name a slice-like counter (held by one device) first.
        over.sort(key=lambda o: (o[2] != 1, o[0][2]))
        if over:
            k, total, have = over[0]
            held = taken.get(k, Decimal(0))
            by_others = f" ({format_quantity(held)} taken by allocated devices)" if held else ""
            where = f" on {node}" if node else ""
            return (
                f"the devices it needs share counters and no choice{where} fits them: e.g. "
                f"{', '.join(users[k])} need {format_quantity(total - held)} of counter {k[2]} of "
                f"{k[1]}, which has {format_quantity(have)}{by_others} (MIG placements of a GPU that "
                "overlap exclude each other)"
            )
    return ""


def _constraint_reasons(
    cluster: Cluster, requests: list[Request], constraints: list[Constraint], ignore_in_use: bool
) -> list[str]:
    out: list[str] = []
    for con in constraints:
        if con.kind != "match":
            continue
        subs = [req.alternatives[0] for req in requests if con.applies(req.alternatives[0])]
        if _drivers_of(cluster, subs) is not None:  # a GPU and a NIC on one PCIe root, ...
            reason = _shared_value_reason(cluster, con, subs, ignore_in_use)
            if reason:
                out.append(reason)
            continue
        need = sum(s.count for s in subs if s.mode == "ExactCount")
        largest, node_of = 0, ""
        noun_pool: list[Device] = []
        tainted: list[tuple[str, Device, str]] = []
        for node in cluster.nodes:
            groups: Counter[Any] = Counter()
            for d in cluster.devices(node):
                fits = [s for s in subs if cluster.selectable(s, d)]
                if not fits:
                    continue
                if not ignore_in_use and all(blocking_taint(d, s) is not None for s in fits):
                    tainted.append((node, d, describe_taint(blocking_taint(d, fits[0]) or {})))
                    continue
                if not ignore_in_use and d.key in cluster.in_use:
                    continue
                value = d.attribute(con.attribute)
                if value is not None:
                    groups[value] += 1
                    noun_pool.append(d)
            if groups and max(groups.values()) > largest:
                largest, node_of = max(groups.values()), node
        if need > largest:
            where = f" ({node_of})" if node_of else ""
            if con.attribute.endswith("/nvlinkDomain"):
                noun = _noun(noun_pool, True) if noun_pool else "GPUs"
                free = "" if ignore_in_use else "free "
                out.append(
                    f"largest {free}NVLink domain: {largest} {noun}{where}; "
                    f"the claim needs {need} NVLink-connected {noun}{_taint_note(tainted)}"
                )
            else:
                out.append(
                    f"at most {largest} devices share one value of {con.attribute}{where}; "
                    f"the constraint needs {need}{_taint_note(tainted)}"
                )
    return out


def _drivers_of(cluster: Cluster, subs: list[SubRequest]) -> list[list[str]] | None:
    """The drivers whose devices each request may get, when the requests of one constraint take
    devices of more than one driver (a GPU of this driver and a NIC of a network driver); else
    None."""
    if len(subs) < 2:
        return None
    drivers = [sorted({d.driver for n in cluster.nodes for d in cluster.candidates(n, s)}) for s in subs]
    return drivers if len({x for ds in drivers for x in ds}) > 1 else None


def _usable_now(cluster: Cluster, sub: SubRequest, d: Device) -> bool:
    """No allocation holds the device (or what the request would consume of a shared one is free)
    and it has no taint the request does not tolerate."""
    if d.key in cluster.in_use and not sub.admin_access:
        return False
    return blocking_taint(d, sub) is None and _fits_now(cluster, sub, d)


def _shared_value_reason(
    cluster: Cluster, con: Constraint, subs: list[SubRequest], ignore_in_use: bool, nodes_shown: int = 2
) -> str:
    """Why no value of a matched attribute has what each request needs, said for requests of
    different drivers: "no pcieRoot on node-a has both a free gpu.dra-gpu.io device (request
    'gpu') and a free nic.example.com device (request 'nic'): roots with a free gpu.dra-gpu.io
    device: pci0000:30, pci0000:c9; with a free nic.example.com device: pci0000:e1". Empty when
    some node has a value that fits them all (then the constraint is not what stands in the way)."""
    ident = con.attribute.rpartition("/")[2]
    label = "roots" if ident == "pcieRoot" else f"{ident} values"
    free = "" if ignore_in_use else "free "
    drivers = _drivers_of(cluster, subs) or [[] for _ in subs]

    def what(sub: SubRequest, ds: list[str]) -> str:
        n = sub.count if sub.mode == "ExactCount" else 1
        kind = "/".join(ds) or f"class {sub.device_class}"
        return f"{'a' if n == 1 else n} {free}{kind} device{'' if n == 1 else 's'}"

    wants = [what(s, ds) for s, ds in zip(subs, drivers, strict=True)]
    if len(set(wants)) < len(wants):  # two requests alike: the lists name their request too
        listed = [f"{w} (request {s.name!r})" for w, s in zip(wants, subs, strict=True)]
    else:
        listed = wants
    per_node: list[tuple[str, list[list[str]]]] = []
    for node in cluster.nodes:
        values: list[dict[Any, str]] = []
        for sub in subs:
            counts: Counter[Any] = Counter()
            shown: dict[Any, str] = {}
            for d in cluster.candidates(node, sub):
                if not ignore_in_use and not _usable_now(cluster, sub, d):
                    continue
                value = d.attribute(con.attribute)
                if value is not None:
                    counts[value] += 1
                    shown[value] = str(value[1])
            need = sub.count if sub.mode == "ExactCount" else 1
            values.append({v: shown[v] for v, n in counts.items() if n >= need})
        if set.intersection(*(set(v) for v in values)):
            return ""
        per_node.append((node, [sorted(v.values()) for v in values]))
    if not per_node:
        return ""
    joined = [f"{w} (request {s.name!r})" for w, s in zip(wants, subs, strict=True)]
    both = "both " if len(joined) == 2 else "all of "
    asked = f"{', '.join(joined[:-1])} and {joined[-1]}"
    # Nodes with some of what each request needs first: the near misses say the most.
    per_node.sort(key=lambda item: sum(not vs for vs in item[1]))
    named = [n for n, _ in per_node if n]
    where = f" on {named[0]}" if len(per_node) == 1 and named else ""
    if len(per_node) > 1:
        where = f" on any of the {len(per_node)} nodes"
    parts = []
    for node, lists in per_node[:nodes_shown]:
        head = f"on {node}, " if len(per_node) > 1 and node else ""
        items = [
            f"{'' if i else head + label + ' '}with {w}: {', '.join(vs) or 'none'}"
            for i, (w, vs) in enumerate(zip(listed, lists, strict=True))
        ]
        parts.append("; ".join(items))
    rest = len(per_node) - nodes_shown
    more = f"; and {rest} more node{'s' if rest > 1 else ''}" if rest > 0 else ""
    return f"no {ident}{where} has {both}{asked}: {'; '.join(parts)}{more}"
