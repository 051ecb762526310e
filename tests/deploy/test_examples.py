"""deploy/examples: each file is claims + pods that fit together, and (where `dra-gpu validate`
exists) every claim and template passes it against the chart's DeviceClasses and the slices of
the simulated nodes they are written for (and, for the GPU + NIC example, a network driver's NICs
beside them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import EXAMPLES, Render, by_kind

EXPECTED = {
    "one-gpu.yaml",
    "four-nvlink-gpus.yaml",
    "gpu-by-product-name.yaml",
    "gpu-memory-40gi.yaml",
    "gpu-driver-550.yaml",
    "mig-3g40gb.yaml",
    "prioritized-h100-else-a100.yaml",
    "shared-gpu-two-pods.yaml",
    "classic-nvidia-gpu.yaml",
    "mps-gpu.yaml",
    "time-sliced-gpu.yaml",
    "gpu-memory-share-20gi.yaml",
    "gpu-and-nic-same-pcie-root.yaml",
    "two-nvlink-gpus-packed.yaml",
}
CLASSES = {"gpu.dra-gpu.io", "mig.dra-gpu.io"}
# The class of a network DRA driver's NICs, which the GPU + NIC example asks for beside a GPU (the
# e2e's NIC driver answers to it: e2e/tests/nic_driver.py); no other example names another's class.
NIC_CLASS = "nic.example.com"
OTHER_CLASSES = {"gpu-and-nic-same-pcie-root.yaml": {NIC_CLASS}}
# A public image (the e2e serves it under this name: e2e/node/images.py), with the default pull
# policy (IfNotPresent for a tag), so that the examples run on any cluster.
IMAGE = "docker.io/library/debian:bookworm-slim"
# What a container of an example prints: what its claim gave (nvidia-smi comes with the claim's
# CDI spec from the node's driver root), its visible devices and device nodes.
REPORT = [
    "set -e",
    "nvidia-smi -L",
    "env | grep -E '^(DRA_GPU|NVIDIA)_VISIBLE_DEVICES=' | sort",
    "ls /dev | grep nvidia",
]


def load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def examples() -> list[Path]:
    return sorted(EXAMPLES.glob("*.yaml"))


def test_every_example_is_there() -> None:
    assert {p.name for p in examples()} == EXPECTED


@pytest.mark.parametrize("path", examples(), ids=lambda p: p.name)
def test_example_pods_reference_their_claims(path: Path) -> None:
    docs = load(path)
    templates = {d["metadata"]["name"] for d in by_kind(docs, "ResourceClaimTemplate")}
    claims = {d["metadata"]["name"] for d in by_kind(docs, "ResourceClaim")}
    pods = by_kind(docs, "Pod")
    assert pods, "an example runs at least one pod"
    for d in docs:
        assert "namespace" not in d["metadata"], "examples go into the namespace they are applied to"
    for pod in pods:
        spec = pod["spec"]
        assert spec["restartPolicy"] == "Never"
        for c in spec["containers"]:
            assert c["image"] == IMAGE and "imagePullPolicy" not in c
            shell, flag, script = c["command"]
            assert (shell, flag) == ("sh", "-c")
            # Only what debian:bookworm-slim has (sh, coreutils, grep): no python there.
            assert script.splitlines()[: len(REPORT)] == REPORT and "python" not in script, script
            names = {rc["name"] for rc in spec.get("resourceClaims", [])}
            assert {x["name"] for x in c["resources"].get("claims", [])} == names
        for rc in spec.get("resourceClaims", []):
            if "resourceClaimTemplateName" in rc:
                assert rc["resourceClaimTemplateName"] in templates
            else:
                assert rc["resourceClaimName"] in claims
    for obj in by_kind(docs, "ResourceClaimTemplate") + by_kind(docs, "ResourceClaim"):
        devices = (
            obj["spec"]["spec"]["devices"]
            if obj["kind"] == "ResourceClaimTemplate"
            else obj["spec"]["devices"]
        )
        for req in devices["requests"]:
            subs = req.get("firstAvailable") or [req["exactly"]]
            assert all(s["deviceClassName"] in CLASSES | OTHER_CLASSES.get(path.name, set()) for s in subs)


def test_classic_pod_uses_the_extended_resource(render: Render) -> None:
    (pod,) = load(EXAMPLES / "classic-nvidia-gpu.yaml")
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    gpu_class = [c for c in by_kind(render(), "DeviceClass") if c["metadata"]["name"] == "gpu.dra-gpu.io"]
    assert limits == {gpu_class[0]["spec"]["extendedResourceName"]: 1}
    assert "resourceClaims" not in pod["spec"]


def nics_beside(gpu_slices: str, roots: int) -> list[dict[str, Any]]:
    """A network driver's class and its NICs on node-a: one on each of the first `roots` PCIe roots
    of the GPUs in `gpu_slices` (YAML of `dra-gpu inventory --slices`), one on a root of its own."""
    slices = list(yaml.safe_load_all(gpu_slices))
    gpu_roots = sorted(
        {
            d["attributes"]["resource.kubernetes.io/pcieRoot"]["string"]
            for s in slices
            for d in s["spec"]["devices"]
        }
    )
    nic_roots = [*gpu_roots[:roots], "pci0000:fe"]
    return [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": NIC_CLASS},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{NIC_CLASS}'"}}]},
        },
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"node-a-{NIC_CLASS}"},
            "spec": {
                "driver": NIC_CLASS,
                "nodeName": "node-a",
                "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
                "devices": [
                    {"name": f"nic{i}", "attributes": {"resource.kubernetes.io/pcieRoot": {"string": root}}}
                    for i, root in enumerate(nic_roots)
                ],
            },
        },
    ]


def test_examples_pass_dra_gpu_validate(render: Render, tmp_path: Path) -> None:
    classes = tmp_path / "classes.yaml"
    classes.write_text(yaml.safe_dump_all(by_kind(render(), "DeviceClass")))
    files = ["-f", str(classes)]
    for profile, node, shares in (
        ("hgx-2x4", "node-a", []),
        ("dgx-a100-mig", "node-b", []),
        ("hgx-2x4", "node-c", ["--memory-shares"]),  # GPUs shared by memory
    ):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "dra_gpu.cli",
                "inventory",
                "--profile",
                profile,
                "--node-name",
                node,
                "--slices",
                *shares,
                "-o",
                "yaml",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        (tmp_path / f"{node}.yaml").write_text(out)
        files += ["-f", str(tmp_path / f"{node}.yaml")]
        if node == "node-a":  # the GPU + NIC example's NICs: two share a root with a GPU
            (tmp_path / "nics.yaml").write_text(yaml.safe_dump_all(nics_beside(out, 2)))
            files += ["-f", str(tmp_path / "nics.yaml")]
    for path in examples():
        # validate checks DeviceClasses, ResourceClaims and templates; the pods are left out.
        claims = [d for d in load(path) if d["kind"] != "Pod"]
        if not claims:
            continue
        f = tmp_path / path.name
        f.write_text(yaml.safe_dump_all(claims))
        r = subprocess.run(
            [sys.executable, "-m", "dra_gpu.cli", "validate", *files, "-f", str(f)],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, f"{path.name}:\n{r.stdout}{r.stderr}"
    # The pairing is checked, not waved through: with no NIC on a GPU's root it can never be placed.
    (tmp_path / "nics.yaml").write_text(
        yaml.safe_dump_all(nics_beside((tmp_path / "node-a.yaml").read_text(), 0))
    )
    example = tmp_path / "gpu-and-nic-same-pcie-root.yaml"
    r = subprocess.run(
        [sys.executable, "-m", "dra_gpu.cli", "validate", *files, "-f", str(example)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and "can never be satisfied" in r.stdout, r.stdout + r.stderr
    assert "no pcieRoot on any of the 3 nodes has both a gpu.dra-gpu.io device (request 'gpu')" in r.stdout
    assert "on node-a, roots with a gpu.dra-gpu.io device: pci0000:15, " in r.stdout, r.stdout
