"""What the controller's e2e files (test_controller_*.py) share: the test's own drivers and classes,
claim builders, and the corpus of claims.

The test slices are published (the `published` fixture of conftest.py) under drivers of our own
(fidelity.dra-gpu.io: hgx-2x4, fidelity-mig.dra-gpu.io: dgx-a100-mig, fidelity-taint.dra-gpu.io:
mixed with device taints) on the real node, so that the scheduler considers them while
another developer's kubelet plugin (gpu.dra-gpu.io) and its classes stay untouched; the classes,
namespaces and the webhook configuration carry a per-run suffix and are deleted at the end. No
kubelet plugin runs for these drivers: a pod that references a claim is allocated by the scheduler
and then stays in ContainerCreating, which is all the fidelity test needs.
"""

from __future__ import annotations

import uuid
from typing import Any

RUN = uuid.uuid4().hex[:6]
HGX = "fidelity.dra-gpu.io"
MIG = "fidelity-mig.dra-gpu.io"
TAINT = "fidelity-taint.dra-gpu.io"
PROFILES = {HGX: "hgx-2x4", MIG: "dgx-a100-mig", TAINT: "mixed"}
GPU_CLASS = f"fid-gpu-{RUN}"  # whole GPUs of HGX
A100_CLASS = f"fid-a100-{RUN}"  # whole GPUs of MIG's node
MIG_CLASS = f"fid-mig-{RUN}"  # MIG devices
TAINT_CLASS = f"fid-taint-{RUN}"  # the mixed profile with tainted devices
ANY_CLASS = f"fid-any-{RUN}"  # whole GPUs of every fidelity driver: several pools, in pool-ID order
CLASS_DRIVER = {GPU_CLASS: HGX, A100_CLASS: MIG, MIG_CLASS: MIG, TAINT_CLASS: TAINT, ANY_CLASS: "*"}
# Taints on the mixed profile's GPUs 0 (NoSchedule) and 2 (NoExecute), by device index.
TAINTS = {
    0: {"key": "example.com/broken", "effect": "NoSchedule"},
    2: {"key": "example.com/flaky", "value": "yes", "effect": "NoExecute"},
}
WEBHOOK_LABEL = "e2e.dra-gpu.io/webhook"
RESOURCE = "resource.k8s.io/v1"


def status_of(exc: Exception) -> int | None:
    return getattr(exc, "status", None)


def ignore_404(fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        if status_of(exc) != 404:
            raise


def device_class(name: str, driver: str, kind: str) -> dict[str, Any]:
    return {
        "apiVersion": RESOURCE,
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {
            "selectors": [
                {
                    "cel": {
                        "expression": (
                            f'device.driver == "{driver}" && device.attributes["{driver}"].type == "{kind}"'
                        )
                    }
                }
            ]
        },
    }


def make_claim(name: str, requests: list[dict[str, Any]], constraints: list[dict[str, Any]] | None = None):
    devices: dict[str, Any] = {"requests": requests}
    if constraints:
        devices["constraints"] = constraints
    return {
        "apiVersion": RESOURCE,
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": devices},
    }


def request(name: str, cls: str, count: int | None = 1, sel: list[str] | None = None, all_: bool = False):
    exactly: dict[str, Any] = {"deviceClassName": cls}
    if all_:
        exactly["allocationMode"] = "All"
    elif count is not None:
        exactly["count"] = count
    if sel:
        exactly["selectors"] = [{"cel": {"expression": e}} for e in sel]
    return {"name": name, "exactly": exactly}


def first_available(name: str, *subs: dict[str, Any]) -> dict[str, Any]:
    out = []
    for s in subs:
        sub = {"name": s["name"], **s["exactly"]}
        out.append(sub)
    return {"name": name, "firstAvailable": out}


def corpus() -> list[dict[str, Any]]:
    """>= 50 claims over both profiles: selectors on every kind of attribute and capacity, counts
    1..8 and All, matchAttribute / distinctAttribute, several requests, firstAvailable, and claims
    that no device set can satisfy."""
    h = f'device.attributes["{HGX}"]'
    hc = f'device.capacity["{HGX}"]'
    m = f'device.attributes["{MIG}"]'
    mc = f'device.capacity["{MIG}"]'
    std = 'device.attributes["resource.kubernetes.io"]'
    nvl = {"matchAttribute": f"{HGX}/nvlinkDomain"}
    g, a, mi = GPU_CLASS, A100_CLASS, MIG_CLASS
    c: list[dict[str, Any]] = []

    def add(requests, constraints=None):
        c.append(make_claim(f"c{len(c):02d}", requests, constraints))

    # -- hgx-2x4: 8x H100, NVLink groups {0-3} and {4-7}, NUMA 0 / 1
    for n in range(1, 9):
        add([request("gpus", g, n)])
    add([request("gpus", g, 9)])  # impossible: 8 GPUs
    add([request("gpus", g, 4, [f'{h}.productName == "NVIDIA H100 80GB HBM3"'])])
    add([request("gpus", g, 1, [f'{h}.productName.startsWith("NVIDIA A100")'])])  # impossible
    add([request("gpus", g, 2, [f'{hc}.memory.compareTo(quantity("80Gi")) >= 0'])])
    add([request("gpus", g, 1, [f'{hc}.memory.isGreaterThan(quantity("100Gi"))'])])  # impossible
    add([request("gpus", g, 3, [f"{h}.index >= 5"])])
    add([request("gpus", g, 4, [f"{h}.index >= 5"])])  # impossible
    add([request("gpus", g, 4, [f"{h}.index % 2 == 1"])])
    add([request("gpus", g, 2, [f'{h}.driverVersion.isGreaterThan(semver("570.0.0"))'])])
    add([request("gpus", g, 1, [f'{h}.driverVersion.isLessThan(semver("560.0.0"))'])])  # impossible
    add(
        [
            request(
                "gpus",
                g,
                2,
                [f'{h}.cudaComputeCapability.compareTo(semver("9.0.0")) >= 0', f'{h}.type == "gpu"'],
            )
        ]
    )
    add([request("gpus", g, 4)], [nvl])
    add([request("gpus", g, 5)], [nvl])  # impossible: groups of 4
    add([request("gpus", g, 2, [f"{h}.index >= 3"])], [nvl])  # backtracks past GPU 3
    add([request("gpus", g, 2)], [{"distinctAttribute": f"{HGX}/nvlinkDomain"}])
    add([request("gpus", g, 3)], [{"distinctAttribute": f"{HGX}/nvlinkDomain"}])  # impossible
    add([request("gpus", g, 8)], [{"distinctAttribute": f"{HGX}/index"}])
    add([request("gpus", g, 4, [f"{h}.index >= 2"])], [{"matchAttribute": f"{HGX}/numaNode"}])
    add([request("gpus", g, 2, [f'{std}.pciBusID == "0000:9a:00.0" || {h}.index == 7'])])
    add([request("gpus", g, 1, [f'{h}.uuid == "GPU-74cfc010-de2d-5afb-99b2-f9f9c785b86d"'])])
    add([request("gpus", g, all_=True)])
    add([request("gpus", g, all_=True, sel=[f"{h}.numaNode == 1"])])
    add([request("gpus", g, 1, [f'{h}.type == "mig"'])])  # impossible: no MIG on hgx
    add([request("a", g, 2, [f"{h}.index < 4"]), request("b", g, 2)], [nvl])  # b must follow a's group
    add([request("a", g, 3), request("b", g, 3)], [{**nvl, "requests": ["b"]}])
    add(
        [request("a", g, 1), request("b", g, 1)],
        [{"distinctAttribute": f"{HGX}/numaNode", "requests": ["a", "b"]}],
    )
    add(
        [
            first_available(
                "gpus",
                request("big", g, 8, [f'{h}.productName.startsWith("NVIDIA A100")']),
                request("small", g, 2),
            )
        ]
    )
    add([first_available("gpus", request("four", g, 4), request("two", g, 2))], [nvl])
    # five can't share a group
    add([first_available("gpus", request("five", g, 5), request("three", g, 3))], [nvl])
    add(
        [
            request("x", g, 6),
            first_available("y", request("three", g, 3), request("two", g, 2), request("one", g, 1)),
        ]
    )
    # A selector that fails at runtime (H100s of this profile publish no multiprocessors): the
    # scheduler reports a SchedulerError, explain "not allocatable" with the failing device.
    add(
        [
            request(
                "gpus",
                g,
                2,
                [f'{hc}.multiprocessors.compareTo(quantity("100")) > 0', f"{h}.nvlinkDomainSize == 4"],
            )
        ]
    )
    add([request("a", g, 1), request("b", g, 3, [f"{h}.index >= 4"])], [nvl])  # backtracks into a
    add([request("gpus", g, all_=True)], [nvl])  # impossible: All spans both groups
    add([request("gpus", g, all_=True, sel=[f"{h}.numaNode == 1"])], [nvl])
    add([request("gpus", g, all_=True, sel=[f'{h}.productName.startsWith("NVIDIA A100")'])])  # none
    add([request("all", g, all_=True), request("one", g, 1)])  # impossible: All took everything
    add(
        [first_available("gpus", request("four", g, 4, [f"{h}.index >= 5"]), request("two", g, 2))],
        [{"distinctAttribute": f"{HGX}/nvlinkDomain", "requests": ["gpus/two"]}],
    )
    add(
        [request("a", g, 1), request("b", g, 1), request("c", g, 1)],
        [{"distinctAttribute": f"{HGX}/numaNode", "requests": ["a", "b"]}, {**nvl, "requests": ["b", "c"]}],
    )
    add([request("gpus", g, 3, [f"{h}.index in [1, 3, 6]"])])
    add([request("gpus", g, 1, [f"{h}.index > 7"])])  # impossible
    add(
        [request("gpus", g, 2, [f'{std}.pcieRoot.startsWith("pci0000:a") || {std}.pcieRoot == "pci0000:d7"'])]
    )
    add(
        [
            request(
                "gpus",
                g,
                8,
                [f'{hc}.memory.compareTo(quantity("81559Mi")) == 0', f'{h}.productName.matches("H1[0-9]0")'],
            )
        ]
    )
    add([request("gpus", g, 1, [f'{hc}.memory.isLessThan(quantity("81559Mi"))'])])  # impossible
    add([request("gpus", g, 2, [f'has({h}.nvlinkDomain) && {h}.architecture.lowerAscii() == "hopper"'])])
    add([request("gpus", g, 1, ['device.attributes["other.example.com"].model == "x"'])])  # runtime error
    add(
        [
            request(
                "gpus",
                g,
                3,
                [
                    f'{h}.productName.split(" ")[1] == "H100" && {h}.index > 2',
                    f'{std}.pciBusID.substring(5, 7).upperAscii() in ["9A", "AB", "DB"]',
                ],
            )
        ]
    )
    # -- dgx-a100-mig: GPUs 3-7 whole (one NVSwitch domain), GPUs 0-2 with 10 MIG devices
    add([request("mig", mi, 1)])
    add([request("mig", mi, 4)])
    add([request("mig", mi, 11)])  # impossible: 10 MIG devices
    for n in (1, 2, 4, 5):  # 4 x 1g.10gb: the fifth is impossible
        add([request("mig", mi, n, [f'{m}.profile == "1g.10gb"'])])
    add([request("mig", mi, 3, [f'{m}.profile == "3g.40gb"'])])
    add([request("mig", mi, 2, [f'{m}.profile == "2g.20gb"'])], [{"distinctAttribute": f"{MIG}/parentIndex"}])
    add([request("mig", mi, 3, [f'{m}.profile == "1g.10gb"'])], [{"matchAttribute": f"{MIG}/parentIndex"}])
    add([request("mig", mi, 2, [f'{mc}.memory.compareTo(quantity("20Gi")) >= 0'])])
    add([request("mig", mi, 4, [f'{mc}.memory.compareTo(quantity("19Gi")) >= 0'])])
    add([request("mig", mi, 3, [f"{m}.parentIndex == 2"])])
    add([request("mig", mi, 3)], [{"distinctAttribute": f"{MIG}/profile"}])
    add([request("mig", mi, all_=True)])
    add([request("mig", mi, all_=True, sel=[f'{m}.profile == "2g.20gb"'])])
    add([request("gpu", a, 5)])
    add([request("gpu", a, 6)])  # impossible: 5 whole GPUs
    add([request("gpu", a, 5)], [{"matchAttribute": f"{MIG}/nvlinkDomain"}])
    add([request("gpu", a, 1, [f"{m}.index == 0"])])  # impossible: GPU 0 is in MIG mode
    add([request("gpu", a, 2), request("mig", mi, 2)])
    add([request("gpu", a, 1), request("mig", mi, 1)], [{"matchAttribute": f"{MIG}/productName"}])
    add([request("gpu", a, 1), request("mig", mi, 1)], [{"matchAttribute": f"{MIG}/uuid"}])  # impossible
    add(
        [
            first_available(
                "dev",
                request("whole0", a, 1, [f"{m}.index == 0"]),
                request("mig", mi, 1, [f'{m}.profile == "3g.40gb"']),
            )
        ]
    )
    add(
        [
            first_available(
                "dev",
                request("big", mi, 1, [f'{mc}.memory.isGreaterThan(quantity("40Gi"))']),
                request("mid", mi, 2, [f'{m}.profile == "2g.20gb"']),
            )
        ]
    )
    add([request("gpu", a, 1, [f'{m}.type == "mig"'])])  # impossible: the class wants whole GPUs
    add([request("gpu", a, 1, [f'{m}.profile == "3g.40gb"'])])  # runtime error: whole GPUs have no profile
    add(
        [request("mig", mi, 2, [f'{m}.profile != "3g.40gb"'])],
        [{"distinctAttribute": f"{MIG}/parentIndex"}, {"matchAttribute": f"{MIG}/productName"}],
    )
    add([request("gpu", a, 1), request("mig", mi, 3)], [{"matchAttribute": f"{MIG}/numaNode"}])
    add(
        [
            first_available(
                "dev",
                request("x", mi, 6, [f'{m}.profile == "3g.40gb"']),
                request("y", a, 6),
                request("z", mi, 2, [f"{m}.parentIndex == 1"]),
            )
        ]
    )
    add([request("migs", mi, all_=True), request("gpus", a, all_=True)])
    add(
        [
            request(
                "mig",
                mi,
                8,
                [
                    f'{m}.productName == "NVIDIA A100-SXM4-80GB"',
                    f'{m}.driverVersion.isGreaterThan(semver("570.100.0"))',
                ],
            )
        ]
    )
    # -- mixed (2x A100 PCIe, 2x L4), GPU 0 tainted NoSchedule, GPU 2 NoExecute (flaky=yes)
    t, tt = TAINT_CLASS, f'device.attributes["{TAINT}"]'

    def tol(req, *tolerations):
        req["exactly"]["tolerations"] = list(tolerations)
        return req

    add([request("gpu", t, 1)])
    add([request("gpu", t, 2)])
    add([request("gpu", t, 3)])  # impossible: two are tainted
    add([tol(request("gpu", t, 3), {"key": "example.com/broken", "operator": "Exists"})])
    add([tol(request("gpu", t, 4), {"operator": "Exists"})])
    add(
        [
            tol(
                request("gpu", t, 1, [f"{tt}.index == 2"]),
                {"key": "example.com/flaky", "operator": "Equal", "value": "yes", "effect": "NoExecute"},
            )
        ]
    )
    add(
        [
            tol(
                request("gpu", t, 1, [f"{tt}.index == 2"]),
                {"key": "example.com/flaky", "operator": "Equal", "value": "no"},
            )
        ]
    )  # impossible: wrong value
    add(
        [
            tol(
                request("gpu", t, 1, [f"{tt}.index == 2"]),
                {"key": "example.com/flaky", "operator": "Exists", "effect": "NoSchedule"},
            )
        ]
    )  # wrong effect
    add([request("gpu", t, all_=True)])
    add([tol(request("gpu", t, all_=True), {"operator": "Exists"})])
    add([request("gpu", t, all_=True, sel=[f'{tt}.productName == "NVIDIA L4"'])])
    add(
        [
            first_available(
                "gpu",
                request("a100", t, 2, [f'{tt}.productName.endsWith("PCIe")']),
                request("l4", t, 1, [f'{tt}.productName == "NVIDIA L4"']),
            )
        ]
    )
    # -- one class over all three drivers: pools in pool-ID order (fidelity-mig < fidelity-taint < fidelity)
    add([request("gpu", ANY_CLASS, 1)])
    add([request("gpu", ANY_CLASS, 8)])
    add([request("gpu", ANY_CLASS, 12)])
    add(
        [
            request(
                "gpu",
                ANY_CLASS,
                2,
                [f'device.driver == "{HGX}" || device.attributes[device.driver].index == 4'],
            )
        ]
    )
    add([request("gpu", ANY_CLASS, 3)], [{"matchAttribute": "resource.kubernetes.io/pcieRoot"}])  # impossible
    add([request("gpu", ANY_CLASS, 3)], [{"distinctAttribute": f"{HGX}/index"}])  # only HGX has it
    add(
        [request("a", ANY_CLASS, 1), request("m", MIG_CLASS, 1), request("h", GPU_CLASS, 2)],
        [{"matchAttribute": f"{HGX}/nvlinkDomain", "requests": ["a", "h"]}],
    )
    add([request("gpu", ANY_CLASS, 1, [f'device.attributes["{MIG}"].?index.orValue(-1) == 5'])])
    add([request("gpu", ANY_CLASS, 1)], [{"matchAttribute": f"{MIG}/profile"}])  # impossible: no profile
    # -- more CEL: presence tests, map membership, cross-type numbers, quantity and semver helpers
    add(
        [
            request(
                "gpus",
                g,
                2,
                [
                    f'!has(device.attributes["other.example.com"].model) && has({h}.numaNode)',
                    f'"nvlinkDomain" in {h} && !("profile" in {h})',
                ],
            )
        ]
    )
    add([request("gpus", g, 2, [f"{h}.index > 2.5 && {h}.index < 6u"])])
    add(
        [
            request(
                "gpus",
                g,
                1,
                [
                    f"{hc}.memory.asApproximateFloat() > 8.5e10 && {hc}.memory.isInteger()",
                    f'sign({hc}.memory.sub(quantity("80Gi"))) == -1',
                ],
            )
        ]
    )
    add(
        [
            request(
                "gpus",
                g,
                2,
                [
                    f"{h}.driverVersion.major() == 570 && {h}.driverVersion.minor() > 100",
                    f'semver("1.2.3").isLessThan({h}.cudaDriverVersion)',
                ],
            )
        ]
    )
    add([request("gpus", g, 2, [f'{h}.productName.matches("^NVIDIA H[0-9]+ 80GB") && size({h}.uuid) == 40'])])
    add([request("gpus", g, 1, ["device.allowMultipleAllocations == false"])])
    add([request("mig", mi, 2, [f'{mc}.memory.add(quantity("1Gi")).compareTo(quantity("11Gi")) < 0'])])
    # firstAvailable backtracking: "four" leaves 4 GPUs, b needs 5, so "two" is chosen
    add([first_available("a", request("four", g, 4), request("two", g, 2)), request("b", g, 5)])
    add(
        [first_available("a", request("four", g, 4), request("two", g, 2)), request("b", g, 3)],
        [{**nvl, "requests": ["a/four", "b"]}],
    )
    return c


def k8s_library_claims() -> list[dict[str, Any]]:
    """Selectors with functions of the Kubernetes CEL libraries that the validator does not model:
    valid for the apiserver, so the validator must not deny them (it warns)."""
    h = f'device.attributes["{HGX}"]'
    exprs = [
        f'{h}.productName.find("H[0-9]+") == "H100"',
        f'{h}.productName.findAll("[0-9]+").size() >= 2',
        f"sets.contains([0, 1, 2, 3], [{h}.index])",
        f"sets.intersects([{h}.index], [4, 5])",
        f"[{h}.index, {h}.numaNode].sum() > 1 && [{h}.numaNode, {h}.index].max() >= 1",
        f"[1, 2].all(i, v, v > i) && {h}.index >= 0",
        f"lists.range(4).exists(i, i == {h}.index)",
        f'isIP("10.0.0.1") && {h}.type == "gpu"',
    ]
    return [make_claim(f"lib{i}", [request("gpus", GPU_CLASS, 1, [e])]) for i, e in enumerate(exprs)]
