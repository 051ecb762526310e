"""The chart's ValidatingAdmissionPolicies evaluated: the rendered variables, validations and
messages run in a real CEL engine (cel-cpp, through cel-expr-python; the apiserver runs cel-go,
and e2e/tests/test_isolation_api.py runs the same policies there) against the requests a
compromised kubelet plugin would make.

- slices: only its node's name, its node's pool and the chart's driver, for create, update
  (before and after) and delete;
- claim status: only its driver's status.devices entries of its own pool; nothing else in status.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from cel_expr_python import cel
from cel_expr_python.ext import ext_optional, ext_strings
from google.protobuf import descriptor_pool

from .conftest import Render, one

DRIVER = "gpu.dra-gpu.io"
PLUGIN = "system:serviceaccount:dra-gpu:dra-gpu-kubelet-plugin"
NODE_KEY = "authentication.kubernetes.io/node-name"

_ENV = cel.NewEnv(
    descriptor_pool.Default(),
    variables={name: cel.Type.DYN for name in ("object", "oldObject", "request")},
    extensions=[ext_optional.ExtOptional(), ext_strings.ExtStrings(2)],
)


class Policy:
    """One rendered policy: `check` gives its first denial's message, None when admitted."""

    def __init__(self, vap: dict[str, Any]) -> None:
        spec = vap["spec"]
        self.match = [m["expression"] for m in spec.get("matchConditions", [])]
        self.variables: dict[str, str] = {}
        for v in spec.get("variables", []):  # later variables may use earlier ones: inlined
            self.variables[v["name"]] = self._inline(v["expression"])
        self.validations = spec["validations"]

    def _inline(self, expression: str) -> str:
        return re.sub(r"variables\.(\w+)", lambda m: f"({self.variables[m.group(1)]})", expression)

    def _eval(self, expression: str, data: dict[str, Any]) -> Any:
        result = _ENV.compile(self._inline(expression)).eval(data=data)
        assert result.type() != cel.Type.ERROR, f"{expression}: {result.value()}"
        return result.value()

    def check(self, user: str, node: str | None, operation: str, obj: Any, old: Any) -> str | None:
        extra = {NODE_KEY: [node]} if node else {}
        data = {
            "request": {"operation": operation, "userInfo": {"username": user, "extra": extra}},
            "object": obj,
            "oldObject": old,
        }
        if not all(self._eval(m, data) for m in self.match):
            return None
        for v in self.validations:
            if not self._eval(v["expression"], data):
                if "messageExpression" in v:
                    return str(self._eval(v["messageExpression"], data))
                return str(v["message"]).strip()
        return None


@pytest.fixture(scope="module")
def policies(render: Render) -> dict[str, Policy]:
    objs = render()
    return {
        "slices": Policy(one(objs, "ValidatingAdmissionPolicy", "slices")),
        "status": Policy(one(objs, "ValidatingAdmissionPolicy", "claim-status")),
    }


def slice_of(node: str, pool: str | None = None, driver: str = DRIVER) -> dict[str, Any]:
    return {
        "metadata": {"name": f"{node}-slice"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": pool or node, "generation": 1, "resourceSliceCount": 1},
        },
    }


def test_slice_policy_admits_the_plugins_own_slices(policies: dict[str, Policy]) -> None:
    p = policies["slices"]
    own = slice_of("node-a")
    assert p.check(PLUGIN, "node-a", "CREATE", own, None) is None
    assert p.check(PLUGIN, "node-a", "UPDATE", own, own) is None
    assert p.check(PLUGIN, "node-a", "DELETE", None, own) is None
    # Other users (the admin, the scheduler) are not matched.
    assert p.check("admin", None, "CREATE", slice_of("node-b", "node-c", "x"), None) is None


@pytest.mark.parametrize(
    ("operation", "obj", "old", "message"),
    [
        (
            "CREATE",
            slice_of("node-b"),
            None,
            "may write only ResourceSlices of its own node, not of node 'node-b'",
        ),
        ("CREATE", slice_of("node-a", "node-b"), None, "whose spec.pool.name is its node, not 'node-b'"),
        (
            "UPDATE",
            slice_of("node-a", "node-b"),
            slice_of("node-a"),
            "whose spec.pool.name is its node, not 'node-b'",
        ),
        (
            "UPDATE",
            slice_of("node-a"),
            slice_of("node-a", "node-b"),
            "whose spec.pool.name is its node, not 'node-b'",
        ),
        ("DELETE", None, slice_of("node-a", "node-b"), "whose spec.pool.name is its node, not 'node-b'"),
        ("CREATE", slice_of("node-a", driver="other.io"), None, f"of driver '{DRIVER}', not 'other.io'"),
        (
            "UPDATE",
            slice_of("node-a"),
            slice_of("node-a", driver="other.io"),
            f"of driver '{DRIVER}', not 'other.io'",
        ),
    ],
    ids=[
        "other-node",
        "other-pool",
        "move-to-other-pool",
        "take-other-pool",
        "delete-other-pool",
        "other-driver",
        "take-other-driver",
    ],
)
def test_slice_policy_denies(
    policies: dict[str, Policy], operation: str, obj: Any, old: Any, message: str
) -> None:
    denial = policies["slices"].check(PLUGIN, "node-a", operation, obj, old)
    assert denial is not None and message in denial, denial


def test_slice_policy_denies_a_token_without_node(policies: dict[str, Policy]) -> None:
    denial = policies["slices"].check(PLUGIN, None, "CREATE", slice_of("node-a"), None)
    assert denial is not None and denial.startswith("no node in the user's token"), denial


# ---------------------------------------------------------------- claim status


def entry(pool: str, device: str, driver: str = DRIVER, **data: Any) -> dict[str, Any]:
    return {"driver": driver, "pool": pool, "device": device, **({"data": data} if data else {})}


def claim_with(
    devices: list[dict[str, Any]], allocation: Any = "default", reserved: Any = None
) -> dict[str, Any]:
    status: dict[str, Any] = {"devices": devices}
    status["allocation"] = (
        {"devices": {"results": [{"device": "a0"}, {"device": "b0"}]}}
        if allocation == "default"
        else allocation
    )
    if reserved is not None:
        status["reservedFor"] = reserved
    return {"metadata": {"name": "c", "namespace": "team-a"}, "status": status}


B0 = entry("node-b", "b0", by="node-b")
A0 = entry("node-a", "a0", by="node-a")


def test_status_policy_admits_the_plugins_own_entries(policies: dict[str, Policy]) -> None:
    p = policies["status"]
    old = claim_with([B0])
    assert p.check(PLUGIN, "node-a", "UPDATE", claim_with([B0, A0]), old) is None  # added
    assert (
        p.check(PLUGIN, "node-a", "UPDATE", claim_with([B0, {**A0, "data": {"x": 1}}]), claim_with([B0, A0]))
        is None
    )
    assert p.check(PLUGIN, "node-a", "UPDATE", claim_with([B0]), claim_with([B0, A0])) is None  # removed
    assert p.check("system:serviceaccount:kube-system:other", None, "UPDATE", claim_with([]), old) is None


@pytest.mark.parametrize(
    ("new", "old", "message"),
    [
        (
            claim_with([{**B0, "data": {"by": "forged"}}]),
            claim_with([B0]),
            "may write only status.devices entries",
        ),
        (claim_with([A0]), claim_with([B0]), "may write only status.devices entries"),
        (
            claim_with([B0, entry("node-a", "x0", "other.io")]),
            claim_with([B0]),
            "may write only status.devices entries",
        ),
        (claim_with([B0], allocation=None), claim_with([B0]), "not its allocation or reservedFor"),
        (
            claim_with([B0], reserved=[{"resource": "pods", "name": "p", "uid": "u"}]),
            claim_with([B0]),
            "not its allocation or reservedFor",
        ),
    ],
    ids=["rewrite-other-pool", "remove-other-pool", "other-driver", "allocation", "reserved-for"],
)
def test_status_policy_denies(policies: dict[str, Policy], new: Any, old: Any, message: str) -> None:
    denial = policies["status"].check(PLUGIN, "node-a", "UPDATE", new, old)
    assert denial is not None and message in denial, denial
    assert "ResourceClaim team-a/c" in denial
