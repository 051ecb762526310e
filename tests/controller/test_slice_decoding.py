"""ResourceSlices read from files are decoded before the allocator or the CEL environment reads
them: each missing or mistyped field the logic relies on is a problem naming the slice and the
field, and the slice is left out of the cluster view."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from dra_gpu.controller.inputs import Inputs

from .objects import node_slices

NAME = "node-a-gpu.dra-gpu.io-0"


def broken(path: list[Any], value: Any = None) -> dict[str, Any]:
    """node-a's first slice with the field at `path` set to `value` (None: removed)."""
    s = copy.deepcopy(node_slices()[0])
    target: Any = s
    for key in path[:-1]:
        target = target[key]
    if value is None:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return s


CASES: dict[str, tuple[dict[str, Any], str]] = {
    "no-spec": (broken(["spec"]), "spec: required"),
    "spec-not-an-object": (broken(["spec"], "x"), "spec: must be an object, got a string"),
    "no-driver": (broken(["spec", "driver"]), "spec.driver: required"),
    "no-pool": (broken(["spec", "pool"]), "spec.pool: required"),
    "pool-without-name": (broken(["spec", "pool", "name"]), "spec.pool.name: required"),
    "slice-count-a-string": (
        broken(["spec", "pool", "resourceSliceCount"], "one"),
        "spec.pool.resourceSliceCount: must be an integer, got a string",
    ),
    "device-without-name": (broken(["spec", "devices", 0, "name"]), "spec.devices[0].name: required"),
    "capacity-without-value": (
        broken(["spec", "devices", 0, "capacity", "memory"], {"requestPolicy": {}}),
        "spec.devices[0].capacity.memory.value: required",
    ),
    "capacity-value-a-list": (
        broken(["spec", "devices", 0, "capacity", "memory"], {"value": [1]}),
        "spec.devices[0].capacity.memory.value: must be a quantity such as 80Gi, got a list",
    ),
    "attribute-of-two-types": (
        broken(["spec", "devices", 0, "attributes", "index"], {"int": 1, "string": "1"}),
        "spec.devices[0].attributes.index: needs exactly one of int, bool, string, version; got int, string",
    ),
    "counter-set-without-counters": (
        broken(["spec", "sharedCounters"], [{"name": "gpu-0"}]),
        "spec.sharedCounters[0].counters: required",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_broken_slice_is_a_field_error(case: str) -> None:
    obj, message = CASES[case]
    inputs = Inputs()
    inputs.add(obj, "in.yaml: document 1")
    assert inputs.slices == []
    assert f"ResourceSlice/{NAME}: {message}" in inputs.problems, inputs.problems


def test_the_driver_s_own_slices_decode() -> None:
    inputs = Inputs()
    for s in node_slices():
        inputs.add(s, "in.yaml")
    assert inputs.problems == [] and len(inputs.slices) == len(node_slices())
