"""Devices share a selector's outcome when they agree on every value it reads (Cluster.matches):
the shared answer must be the one the device's own evaluation gives, always."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dra_gpu.controller.allocation_errors import AllocationError
from dra_gpu.controller.allocator_view import Cluster
from dra_gpu.controller.cel import CelEnvironment, Schema, SelectorEvalError
from dra_gpu.controller.cel.environment import Selector, selector_reads
from dra_gpu.controller.published_devices import Device

from .objects import DRIVER, GPU_CLASS, node_slices

D = f'device.attributes["{DRIVER}"]'
C = f'device.capacity["{DRIVER}"]'


@pytest.mark.parametrize(
    ("expression", "reads"),
    [
        (f'{D}.productName.startsWith("NVIDIA H100")', [("attributes", DRIVER, "productName")]),
        (
            f"{C}['memory'].compareTo(quantity(\"40Gi\")) >= 0 && {D} . driverVersion.major() > 1",
            [("capacity", DRIVER, "memory"), ("attributes", DRIVER, "driverVersion")],
        ),
        (f'device.driver == "{DRIVER}" && !device.allowMultipleAllocations', []),
        (f"has({D}.uuid)", [("attributes", DRIVER, "uuid")]),
        ('device.attributes["example.com"]["a-b"] == 1', [("attributes", "example.com", "a-b")]),
    ],
)
def test_literal_reads_are_found(expression: str, reads: list[tuple[str, str, str]]) -> None:
    assert selector_reads(expression) == tuple(reads)


@pytest.mark.parametrize(
    "expression",
    [
        f"{D}.size() > 3",  # the whole map
        f'"uuid" in {D}',
        f'{D}.exists(k, k == "uuid")',
        f"{D} . size () > 3",
        f'device.attributes["{DRIVER}" + ""].uuid == "x"',  # a computed key
        f'{D}[{D}.productName] == "x"',
        f'cel.bind(d, device, d.attributes["{DRIVER}"].uuid == "x")',  # device under another name
        f'device.attributes[r"{DRIVER}"].uuid == "x"',  # a prefixed literal
        'device.attributes["gpu\\x2edra-gpu.io"].uuid == "x"',  # an escape
        f"{D}.?uuid.hasValue()",
        f"{D}.size // a comment\n() > 3",
        f'{D}.productName == "device"',  # the word in a string literal: not worked out, safe
        "device == {}",
    ],
)
def test_other_reads_make_each_device_evaluated_on_its_own(expression: str) -> None:
    assert selector_reads(expression) is None


# Selectors over the values the devices below vary in; a few that fail at runtime on some.
SELECTORS = [
    f'{D}.productName.startsWith("NVIDIA H100")',
    f'{C}.memory.compareTo(quantity("40Gi")) >= 0',
    f'{D}.driverVersion.isGreaterThan(semver("550.0.0"))',
    f"{D}.flag == true",  # an int 1 and a bool true are different values
    f'has({D}.flag) && device.attributes["example.com"].zone == "a"',
    "device.allowMultipleAllocations",
    f'{D}["productName"] == "NVIDIA A100"',
]
NAMES = ["productName", f"{DRIVER}/productName", f"/{DRIVER}", "flag", f"{DRIVER}/flag", "example.com/zone"]
VALUES = st.sampled_from(
    [
        {"string": "NVIDIA H100 80GB HBM3"},
        {"string": "NVIDIA A100"},
        {"string": "a"},
        {"int": 1},
        {"bool": True},
        {"version": "570.1.0"},
        {"version": "535.0.0"},
        {"string": "a", "int": 1},  # two kinds: the first one counts
    ]
)


def _device(name: str, attributes: dict[str, Any], memory: str, multi: bool) -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {f"{DRIVER}/driverVersion": {"version": "570.1.0"}, **attributes},
        "capacity": {"memory": {"value": memory}},
        "allowMultipleAllocations": multi,
    }


DEVICES = st.lists(
    st.tuples(
        st.dictionaries(st.sampled_from(NAMES), VALUES, max_size=4),
        st.sampled_from(["80Gi", "20Gi", "40Gi", "40960Mi"]),
        st.booleans(),
    ),
    min_size=2,
    max_size=8,
)


def _own_outcome(env: CelEnvironment, expression: str, device: Device) -> bool | str:
    """The device's answer evaluated on its own view, with nothing shared."""
    try:
        return env.evaluate(env.compile(expression), env.device_view(device.driver, device.raw))
    except SelectorEvalError as exc:
        return f"selector {expression!r} failed on device {device.name} ({device.pool}): {exc}"


def _cluster(env: CelEnvironment, devices: list[dict[str, Any]]) -> Cluster:
    (base,) = node_slices("node-a", "pcie-pairs")
    base["spec"]["devices"] = devices
    return Cluster(env, [base], {"gpu.dra-gpu.io": GPU_CLASS})


@pytest.fixture(scope="module")
def env() -> CelEnvironment:
    return CelEnvironment(Schema.default(DRIVER))


@settings(max_examples=80, deadline=None)
@given(devices=DEVICES)
def test_a_shared_outcome_is_the_devices_own(devices: list[Any]) -> None:
    env = CelEnvironment(Schema.default(DRIVER))
    cluster = _cluster(env, [_device(f"gpu-{i}", *d) for i, d in enumerate(devices)])
    for expression in SELECTORS:
        for device in cluster.devices("node-a"):
            try:
                got: bool | str = cluster.matches(expression, device)
            except AllocationError as exc:
                got = str(exc)
            assert got == _own_outcome(env, expression, device), (expression, device.raw)


def test_devices_differing_in_one_read_value_get_their_own_answers(env: CelEnvironment) -> None:
    same = {"productName": {"string": "NVIDIA H100 80GB HBM3"}}
    cluster = _cluster(
        env,
        [
            _device("h100", same, "80Gi", False),
            _device("h100-other-uuid", {**same, "uuid": {"string": "GPU-2"}}, "80Gi", False),
            _device("a100", {"productName": {"string": "NVIDIA A100"}}, "80Gi", False),
            _device("small", same, "20Gi", False),
            _device("shared", same, "80Gi", True),
        ],
    )
    h100, other_uuid, a100, small, shared = cluster.devices("node-a")
    product, memory, multi = SELECTORS[0], SELECTORS[1], SELECTORS[5]
    assert [cluster.matches(product, d) for d in (h100, other_uuid, a100)] == [True, True, False]
    assert [cluster.matches(memory, d) for d in (h100, small)] == [True, False]
    assert [cluster.matches(multi, d) for d in (h100, shared)] == [False, True]


class CountingEnvironment(CelEnvironment):
    """A real environment that counts its evaluations."""

    evaluations = 0

    def evaluate(self, selector: Selector, view: dict[str, Any], activation: Any | None = None) -> bool:
        self.evaluations += 1
        return super().evaluate(selector, view, activation)


def test_a_selector_runs_once_per_distinct_set_of_read_values() -> None:
    env = CountingEnvironment(Schema.default(DRIVER))
    slices = [s for n in range(10) for s in node_slices(f"node-{n}", "hgx-2x4")]
    cluster = Cluster(env, slices, {"gpu.dra-gpu.io": GPU_CLASS})
    devices = [d for node in cluster.nodes for d in cluster.devices(node)]
    assert len(devices) == 80
    assert all(cluster.matches(SELECTORS[0], d) for d in devices)
    assert env.evaluations == 1  # 80 GPUs of one product
    domain = f'{D}.nvlinkDomain != ""'
    assert all(cluster.matches(domain, d) for d in devices)
    assert env.evaluations == 1 + 20  # two NVLink domains on each of the 10 nodes


def test_a_runtime_error_names_each_device_it_fails_on(env: CelEnvironment) -> None:
    cluster = _cluster(env, [_device("gpu-0", {}, "80Gi", False), _device("gpu-1", {}, "80Gi", False)])
    for device in cluster.devices("node-a"):
        with pytest.raises(AllocationError, match=f"failed on device {device.name} "):
            cluster.matches(f'{D}.zone == "a"', device)
