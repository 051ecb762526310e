"""The shapes of the objects the controller accepts (resource.k8s.io/v1 and AdmissionReview), as
the apiserver's decoder types them: applied by `decode_object` before any rule runs, so the rules,
the CEL environment and the allocator only ever see the types they expect.

Fields the driver does not read are left as they come (`ANY`); the apiserver checks them.
"""

from __future__ import annotations

from typing import Any

from dra_gpu.common.decoding import ANY, Bool, Int, ListOf, MapOf, Obj, Problems, Shape, Str, decode
from dra_gpu.kube.values import Quantity

METADATA = Obj(
    {
        "name": Str(),
        "generateName": Str(),
        "namespace": Str(),
        "uid": Str(),
        "resourceVersion": Str(),
        "labels": MapOf(Str()),
        "annotations": MapOf(Str()),
    }
)
SELECTOR = Obj({"cel": Obj({"expression": Str()})})
OPAQUE = Obj({"driver": Str(), "parameters": ANY})
CLASS_CONFIG = Obj({"opaque": OPAQUE})
CLAIM_CONFIG = Obj({"requests": ListOf(Str()), "opaque": OPAQUE})
TOLERATION = Obj(
    {"key": Str(), "operator": Str(), "value": Str(), "effect": Str(), "tolerationSeconds": Int()}
)
_EXACT_FIELDS: dict[str, Shape] = {
    "deviceClassName": Str(),
    "selectors": ListOf(SELECTOR),
    "allocationMode": Str(),
    "count": Int(),
    "adminAccess": Bool(),
    "tolerations": ListOf(TOLERATION),
    "capacity": Obj({"requests": MapOf(Quantity())}),
}
EXACT = Obj(_EXACT_FIELDS)
SUBREQUEST = Obj({"name": Str(), **_EXACT_FIELDS})
REQUEST = Obj({"name": Str(), "exactly": EXACT, "firstAvailable": ListOf(SUBREQUEST)})
CONSTRAINT = Obj({"requests": ListOf(Str()), "matchAttribute": Str(), "distinctAttribute": Str()})
CLAIM_SPEC = Obj(
    {
        "devices": Obj(
            {"requests": ListOf(REQUEST), "constraints": ListOf(CONSTRAINT), "config": ListOf(CLAIM_CONFIG)}
        )
    },
    "an object with 'devices'",
)
RESULT = Obj({"request": Str(), "driver": Str(), "pool": Str(), "device": Str(), "adminAccess": Bool()})
CLAIM_STATUS = Obj({"allocation": Obj({"devices": Obj({"results": ListOf(RESULT)})})})
ATTRIBUTE = Obj(
    {"int": Int(), "bool": Bool(), "string": Str(), "version": Str()},
    one_of=("int", "bool", "string", "version"),
)
# A counter or a capacity: its value is what the allocator adds up.
COUNTER = Obj({"value": Quantity()}, required=("value",))
DEVICE = Obj(
    {
        "name": Str(),
        "attributes": MapOf(ATTRIBUTE),
        "capacity": MapOf(COUNTER),
        "consumesCounters": ListOf(
            Obj({"counterSet": Str(), "counters": MapOf(COUNTER)}, required=("counterSet", "counters"))
        ),
        "nodeName": Str(),
        "allNodes": Bool(),
        "taints": ListOf(Obj({"key": Str(), "value": Str(), "effect": Str()})),
        "allowMultipleAllocations": Bool(),
    },
    required=("name",),
)
SLICE_SPEC = Obj(
    {
        "driver": Str(),
        "pool": Obj(
            {"name": Str(), "generation": Int(), "resourceSliceCount": Int()},
            required=("name", "resourceSliceCount"),
        ),
        "nodeName": Str(),
        "allNodes": Bool(),
        "perDeviceNodeSelection": Bool(),
        "devices": ListOf(DEVICE),
        "sharedCounters": ListOf(
            Obj({"name": Str(), "counters": MapOf(COUNTER)}, required=("name", "counters"))
        ),
    },
    required=("driver", "pool"),
)


def _object(spec: Shape, status: Shape = ANY, required: tuple[str, ...] = ()) -> Obj:
    return Obj(
        {"apiVersion": Str(), "kind": Str(), "metadata": METADATA, "spec": spec, "status": status},
        required=required,
    )


SHAPES: dict[str, Obj] = {
    "DeviceClass": _object(
        Obj({"selectors": ListOf(SELECTOR), "config": ListOf(CLASS_CONFIG), "extendedResourceName": Str()})
    ),
    "ResourceClaim": _object(CLAIM_SPEC, CLAIM_STATUS),
    "ResourceClaimTemplate": _object(Obj({"metadata": METADATA, "spec": CLAIM_SPEC})),
    # The allocator reads a slice's spec, pool, driver and every device's name and values.
    "ResourceSlice": _object(SLICE_SPEC, required=("spec",)),
}
GENERIC = _object(ANY)
ADMISSION_REVIEW = Obj(
    {
        "apiVersion": Str(),
        "kind": Str(),
        "request": Obj(
            {
                "uid": Str(),
                "kind": Obj({"group": Str(), "version": Str(), "kind": Str()}),
                "operation": Str(),
                "object": Obj({}),
                "oldObject": Obj({}),
            }
        ),
    }
)


def decode_object(obj: Any, path: str = "") -> Problems:
    """The type problems of one Kubernetes object, by its kind; empty when the rules may read it."""
    kind = obj.get("kind") if isinstance(obj, dict) else None
    return decode(obj, SHAPES.get(kind, GENERIC) if isinstance(kind, str) else GENERIC, path)


def object_label(obj: Any) -> str:
    """`<Kind>/<name>` of an object that may be malformed, for messages."""
    if not isinstance(obj, dict):
        return "?/?"
    meta: dict[str, Any] = obj["metadata"] if isinstance(obj.get("metadata"), dict) else {}
    name = meta.get("name") or meta.get("generateName") or "?"
    kind = obj.get("kind") or "?"
    return f"{kind if isinstance(kind, str) else '?'}/{name if isinstance(name, str) else '?'}"
