"""The view as JSON (`dra-gpu top -o json`): the same facts as the text, with exact numbers
(bytes, not rounded GiB) and every holder's claim, for scripts."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from dra_gpu.fleet.pending import PendingClaim
from dra_gpu.fleet.snapshot import Taint
from dra_gpu.fleet.view import DomainView, FleetView, GpuView, Holder, NodeView, Totals


def _totals(t: Totals) -> dict[str, int]:
    return asdict(t)


def _taint(t: Taint) -> dict[str, str]:
    return {"key": t.key, "value": t.value, "effect": t.effect, "source": t.source}


def _holder(h: Holder) -> dict[str, Any]:
    out: dict[str, Any] = {
        "namespace": h.namespace,
        "claim": h.claim,
        "pods": [{"name": p.name, "phase": p.phase or None} for p in h.pods],
    }
    if h.memory is not None:
        out["memory"] = h.memory
    if h.mps_daemons:
        out["mpsDaemons"] = [{"pod": d.name, "phase": d.phase or None} for d in h.mps_daemons]
    return out


def _gpu(g: GpuView) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": g.name,
        "uuid": g.uuid,
        "index": g.index,
        "product": g.product,
        "memory": g.memory,
        "state": g.state.value,
        "tainted": g.tainted,
        "taints": [_taint(t) for t in g.taints],
        "holders": [_holder(h) for h in g.holders],
    }
    if g.free_memory is not None:
        out["freeMemory"] = g.free_memory
    if g.mig is not None:
        out["mig"] = {
            "dynamic": g.mig.dynamic,
            "used": [
                {"device": i.device, "profile": i.profile, "holders": [_holder(h) for h in i.holders]}
                for i in g.mig.used
            ],
            "free": {profile: n for profile, n in g.mig.free},
            "memorySlicesUsed": g.mig.slices_used,
            "memorySlices": g.mig.slices_total,
        }
    return out


def _domain(d: DomainView) -> dict[str, Any]:
    return {"kind": d.kind.value, "nvlinkDomain": d.domain, "gpus": [_gpu(g) for g in d.gpus]}


def _node(n: NodeView) -> dict[str, Any]:
    return {"name": n.name, "totals": _totals(n.totals), "domains": [_domain(d) for d in n.domains]}


def _pending(p: PendingClaim) -> dict[str, Any]:
    return {
        "namespace": p.namespace,
        "pod": p.pod,
        "claim": p.claim,
        "fits": p.fits,
        "node": p.node or None,
        "devices": list(p.devices),
        "reason": p.reason or None,
    }


def view_to_json(view: FleetView) -> dict[str, Any]:
    return {
        "filters": dict(view.filters),
        "totals": _totals(view.totals),
        "models": {product: _totals(t) for product, t in view.models},
        "nodes": [_node(n) for n in view.nodes],
        "pending": [_pending(p) for p in view.pending],
        "problems": list(view.problems),
    }
