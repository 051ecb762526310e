"""The shape of a ResourceClaim's status as prepare reads it.

The apiserver validates allocations, but prepare must not trust that: a claim written by another
version, a buggy client with status rights or a hand-edited object would otherwise fail with an
AttributeError deep inside prepare. A bad shape is a claim error that names the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dra_gpu.common.decoding import Bool, ListOf, MapOf, Obj, Str, decode
from dra_gpu.kube.values import Quantity

RESULT = Obj(
    {
        "request": Str(),
        "driver": Str(),
        "pool": Str(),
        "device": Str(),
        "adminAccess": Bool(),
        "shareID": Str(),
        "consumedCapacity": MapOf(Quantity()),
    }
)
CONFIG = Obj({"source": Str(), "requests": ListOf(Str()), "opaque": Obj({"driver": Str()})})
STATUS = Obj({"allocation": Obj({"devices": Obj({"results": ListOf(RESULT), "config": ListOf(CONFIG)})})})


def status_problem(claim: Mapping[str, Any]) -> str | None:
    """The first problem of the claim's status ("status.allocation...: must be ..."), or None."""
    problems = decode(claim.get("status") or {}, STATUS, "status")
    if not problems:
        return None
    path, message = problems[0]
    return f"{path}: {message}"
