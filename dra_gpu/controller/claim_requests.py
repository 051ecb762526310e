"""What a claim asks for, as the structured allocator reads `spec.devices`: its requests, each with
its `firstAvailable` alternatives in listed order, their capacity requests, and the match / distinct
constraints between them, with the API's defaults applied."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from dra_gpu.kube.values import quantity_or_none


@dataclass
class SubRequest:
    """One alternative of a request: the request itself (`sub` None) or one `firstAvailable` entry."""

    request: str
    sub: str | None
    device_class: str
    selectors: list[str]
    mode: str  # ExactCount | All
    count: int
    admin_access: bool
    tolerations: list[Mapping[str, Any]]
    capacity: dict[str, Decimal] = field(default_factory=dict)  # capacity.requests

    @property
    def name(self) -> str:
        return f"{self.request}/{self.sub}" if self.sub else self.request


@dataclass
class Request:
    name: str
    alternatives: list[SubRequest]


@dataclass
class Constraint:
    kind: str  # match | distinct
    attribute: str
    requests: list[str]

    def applies(self, sub: SubRequest) -> bool:
        return not self.requests or sub.request in self.requests or sub.name in self.requests


def parse_requests(spec: Mapping[str, Any]) -> tuple[list[Request], list[Constraint]]:
    """Requests and constraints of a claim's `spec.devices`, with API defaults applied."""
    devices = spec.get("devices") or {}
    requests: list[Request] = []
    for r in devices.get("requests") or []:
        name = str(r.get("name", ""))
        if r.get("firstAvailable"):
            alts = [_sub(name, s.get("name"), s) for s in r["firstAvailable"]]
        else:
            alts = [_sub(name, None, r.get("exactly") or r)]
        requests.append(Request(name, alts))
    constraints: list[Constraint] = []
    for c in devices.get("constraints") or []:
        if c.get("matchAttribute"):
            constraints.append(Constraint("match", str(c["matchAttribute"]), list(c.get("requests") or [])))
        elif c.get("distinctAttribute"):
            constraints.append(
                Constraint("distinct", str(c["distinctAttribute"]), list(c.get("requests") or []))
            )
    return requests, constraints


def _sub(request: str, sub: Any, body: Mapping[str, Any]) -> SubRequest:
    mode = body.get("allocationMode") or "ExactCount"
    count = body.get("count")
    return SubRequest(
        request=request,
        sub=str(sub) if sub else None,
        device_class=str(body.get("deviceClassName", "")),
        selectors=[
            str((s.get("cel") or {}).get("expression", ""))
            for s in body.get("selectors") or []
            if isinstance(s, dict)
        ],
        mode=str(mode),
        count=int(count) if isinstance(count, int) and not isinstance(count, bool) else 1,
        admin_access=bool(body.get("adminAccess", False)),
        tolerations=list(body.get("tolerations") or []),
        capacity=_capacity_requests(body),
    )


def _capacity_requests(body: Mapping[str, Any]) -> dict[str, Decimal]:
    requests = (body.get("capacity") or {}).get("requests") or {}
    out = {}
    for name, value in requests.items() if isinstance(requests, dict) else ():
        amount = quantity_or_none(value)
        if amount is not None:
            out[str(name).rpartition("/")[2]] = amount
    return out
