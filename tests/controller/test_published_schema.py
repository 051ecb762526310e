"""What the slices publish and what the validator's CEL schema knows are the same list.

A selector on an attribute the slices publish must never be rejected as "unknown attribute", nor
type-checked against another type than the one published.
"""

from __future__ import annotations

from typing import Any

import pytest
from simnode.fake import discover_node
from simnode.profiles import BUILTIN_PROFILES

from dra_gpu.controller.rules import Validator
from dra_gpu.model.attributes import STANDARD_ATTRIBUTES, STANDARD_DOMAIN
from dra_gpu.node.slices import build_slices

from .objects import DRIVER

# A comparison that type-checks only against a value of this kind.
TYPED_COMPARISON = {
    "string": '{ref} == "x"',
    "int": "{ref} == 1",
    "bool": "{ref} == true",
    "version": '{ref}.compareTo(semver("1.0.0")) >= 0',
}


def published_devices(profile: str) -> list[dict[str, Any]]:
    slices = build_slices(discover_node("node-a", profile), DRIVER)
    return [d for s in slices for d in s["spec"]["devices"]]


@pytest.mark.parametrize("profile", BUILTIN_PROFILES)
def test_every_published_attribute_is_in_the_cel_schema_with_its_type(profile: str) -> None:
    env = Validator(DRIVER).env  # the schema without learning from slices: what the driver declares
    seen: set[str] = set()
    for dev in published_devices(profile):
        for key, value in dev["attributes"].items():
            domain, _, name = key.rpartition("/")
            ((kind, _),) = value.items()
            if domain == STANDARD_DOMAIN:  # read dynamically by selectors, as in Kubernetes
                assert STANDARD_ATTRIBUTES.get(name) == kind, key
                continue
            assert domain in ("", DRIVER), key
            assert env.schema.attributes.get(name) == kind, f"{dev['name']}: {key} is {kind}"
            if name not in seen:
                seen.add(name)
                ref = f'device.attributes["{DRIVER}"].{name}'
                assert env.check(TYPED_COMPARISON[kind].format(ref=ref)) == [], key
        for key in dev["capacity"]:
            domain, _, name = key.rpartition("/")
            assert domain in ("", DRIVER) and name in env.schema.capacities, f"{dev['name']}: {key}"
            expression = f'device.capacity["{DRIVER}"].{name}.compareTo(quantity("1")) >= 0'
            assert env.check(expression) == [], key


def test_a_comparison_of_the_wrong_type_is_refused() -> None:
    """The check above means something: the typed comparisons fail on another type."""
    env = Validator(DRIVER).env
    ref = f'device.attributes["{DRIVER}"]'
    assert env.check(TYPED_COMPARISON["int"].format(ref=f"{ref}.productName"))
    assert env.check(TYPED_COMPARISON["string"].format(ref=f"{ref}.index"))
    assert env.check(TYPED_COMPARISON["version"].format(ref=f"{ref}.index"))
