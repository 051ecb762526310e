"""`explain` and `validate` for a claim whose constraint spans two drivers: a GPU of dra-gpu and a
NIC of a network driver on one PCIe root (GPUDirect RDMA), `matchAttribute:
resource.kubernetes.io/pcieRoot`. The pcie-pairs node's GPUs sit on roots pci0000:16, :30, :b0 and
:c9; the network driver's NICs on :16, :b0 and :e1 (a root without a GPU)."""

from __future__ import annotations

from typing import Any

from dra_gpu.controller.commands import explain_inputs, render_text
from dra_gpu.controller.inputs import Inputs
from dra_gpu.controller.rules import ProblemKind, Validator

from .objects import DRIVER, GPU_CLASS, device_names, node_slices

NIC_DRIVER = "nic.example.com"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
NIC_CLASS: dict[str, Any] = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceClass",
    "metadata": {"name": NIC_DRIVER},
    "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{NIC_DRIVER}"'}}]},
}
NIC_ROOTS = {"nic0": "pci0000:16", "nic1": "pci0000:b0", "nic2": "pci0000:e1"}


def nic_slice(node: str = "node-a", roots: dict[str, str] = NIC_ROOTS) -> dict[str, Any]:
    """What a network DRA driver publishes: its own pool on the node, NICs with the standard
    PCIe-root attribute (and nothing of dra-gpu's)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{NIC_DRIVER}"},
        "spec": {
            "driver": NIC_DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {"name": name, "attributes": {PCIE_ROOT: {"string": root}, "model": {"string": "cx7"}}}
                for name, root in roots.items()
            ],
        },
    }


def pair(name: str, gpu_selectors: list[str] | None = None) -> dict[str, Any]:
    gpu: dict[str, Any] = {"deviceClassName": "gpu.dra-gpu.io"}
    if gpu_selectors:
        gpu["selectors"] = [{"cel": {"expression": e}} for e in gpu_selectors]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "devices": {
                "requests": [
                    {"name": "gpu", "exactly": gpu},
                    {"name": "nic", "exactly": {"deviceClassName": NIC_DRIVER}},
                ],
                "constraints": [{"requests": ["gpu", "nic"], "matchAttribute": PCIE_ROOT}],
            }
        },
    }


def holding(name: str, node: str, gpu: str, nic: str) -> dict[str, Any]:
    c = pair(name)
    c["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {"request": "gpu", "driver": DRIVER, "pool": node, "device": gpu},
                    {"request": "nic", "driver": NIC_DRIVER, "pool": node, "device": nic},
                ]
            }
        }
    }
    return c


def gpus(node: str = "node-a") -> list[dict[str, Any]]:
    return node_slices(node, "pcie-pairs")


def run(slices: list[dict[str, Any]], *objs: dict[str, Any]) -> dict[str, Any]:
    inputs = Inputs()
    for o in [*slices, GPU_CLASS, NIC_CLASS, *objs]:
        inputs.add(o, "test")
    return explain_inputs(inputs)


def test_gpu_and_nic_land_on_one_root_and_explain_names_it() -> None:
    names = device_names(gpus())  # by PCI address: roots :16, :30, :b0, :c9
    result = run([*gpus(), nic_slice()], pair("rdma"))
    (entry,) = result["claims"]
    assert entry["allocatable"] and entry["devices"] == [names[0], "nic0"]
    assert [(r["request"], r["driver"]) for r in entry["results"]] == [("gpu", DRIVER), ("nic", NIC_DRIVER)]
    assert entry["sharedAttributes"] == [
        {
            "attribute": PCIE_ROOT,
            "value": "pci0000:16",
            "requests": ["gpu", "nic"],
            "drivers": [DRIVER, NIC_DRIVER],
        }
    ]
    # A NIC has no NVLink: one GPU beside it costs nothing.
    assert entry["linkCost"] == 0
    assert render_text(result).splitlines() == [
        f"default/rdma: node node-a, devices {names[0]}, nic0 (link cost 0)",
        "  gpu and nic on pcieRoot pci0000:16",
    ]


def test_the_next_root_with_both_when_the_first_is_held() -> None:
    names = device_names(gpus())
    # GPU :30 has no NIC beside it: the allocator passes it over for the GPU on :b0.
    (entry,) = run([*gpus(), nic_slice()], holding("busy", "node-a", names[0], "nic0"), pair("rdma"))[
        "claims"
    ]
    assert entry["devices"] == [names[2], "nic1"]
    assert entry["sharedAttributes"][0]["value"] == "pci0000:b0"


def test_no_root_left_with_both_says_which_roots_have_which() -> None:
    names = device_names(gpus())
    held = [holding("a", "node-a", names[0], "nic0"), holding("b", "node-a", names[2], "nic1")]
    result = run([*gpus(), nic_slice()], *held, pair("rdma"))
    (entry,) = result["claims"]
    assert not entry["allocatable"] and not entry["invalid"]
    assert entry["reason"] == (
        f"no pcieRoot on node-a has both a free {DRIVER} device (request 'gpu') and a free "
        f"{NIC_DRIVER} device (request 'nic'): roots with a free {DRIVER} device: pci0000:30, "
        f"pci0000:c9; with a free {NIC_DRIVER} device: pci0000:e1"
    )
    assert render_text(result) == f"default/rdma: not allocatable: {entry['reason']}"


def test_a_gpu_on_a_root_without_a_nic_can_never_be_paired() -> None:
    """validate (what the webhook runs): the GPU the selector picks sits on :30, where no NIC is."""
    validator = Validator(DRIVER, [*gpus(), nic_slice()], [GPU_CLASS, NIC_CLASS])
    verdict = validator.validate(pair("rdma", [f'device.attributes["{DRIVER}"].index == 1']))
    assert verdict.concerned
    (problem,) = verdict.errors
    assert problem.kind is ProblemKind.UNSATISFIABLE
    assert problem.message == (
        "can never be satisfied by the published devices: no pcieRoot on node-a has both a "
        f"{DRIVER} device (request 'gpu') and a {NIC_DRIVER} device (request 'nic'): roots with a "
        f"{DRIVER} device: pci0000:30; with a {NIC_DRIVER} device: pci0000:16, pci0000:b0, pci0000:e1"
    )


def test_several_nodes_the_near_misses_first() -> None:
    """node-0 has GPUs and no NIC at all; node-a and node-b have both, never on one root: those two
    are said (the first two), node-0 is counted."""
    slices = [*gpus("node-0"), *gpus("node-a"), *gpus("node-b")]
    slices += [nic_slice("node-a", {"nic0": "pci0000:e1"}), nic_slice("node-b", {"nic0": "pci0000:e2"})]
    (entry,) = run(slices, pair("rdma"))["claims"]
    assert entry["reason"] == (
        f"no pcieRoot on any of the 3 nodes has both a free {DRIVER} device (request 'gpu') and a "
        f"free {NIC_DRIVER} device (request 'nic'): on node-a, roots with a free {DRIVER} device: "
        f"pci0000:16, pci0000:30, pci0000:b0, pci0000:c9; with a free {NIC_DRIVER} device: "
        f"pci0000:e1; on node-b, roots with a free {DRIVER} device: pci0000:16, pci0000:30, "
        f"pci0000:b0, pci0000:c9; with a free {NIC_DRIVER} device: pci0000:e2; and 1 more node"
    )


def test_a_network_driver_that_has_not_published_yet_is_not_held_against_the_claim() -> None:
    """Only dra-gpu's slices so far (the network driver's pods still starting): the webhook warns
    instead of refusing; explain says the claim cannot be placed now, and why."""
    validator = Validator(DRIVER, gpus(), [GPU_CLASS, NIC_CLASS])
    verdict = validator.validate(pair("rdma"))
    assert verdict.allowed
    (warning,) = verdict.warnings
    assert warning.kind is ProblemKind.NOT_CHECKED
    assert warning.message == (
        f"feasibility not checked: request 'nic': class '{NIC_DRIVER}' is not {DRIVER}'s and selects "
        "no published device (its driver may not have published its slices yet)"
    )
    (entry,) = run(gpus(), pair("rdma"))["claims"]
    assert entry["reason"] == f"request 'nic': no published device belongs to class '{NIC_DRIVER}'"
