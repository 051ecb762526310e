"""The dgx-a100-40gb-mig profile: a DGX A100 40GB laid out for NVIDIA's DRA driver demo
quickstart/v1/gpu-test4.yaml (mig-parted config `half-balanced`: GPUs 0-3 with 2x 1g.5gb,
2g.10gb and 3g.20gb, GPUs 4-7 whole). The profile loads, discovery and the slices show the
layout, NVIDIA's way of naming a profile from its memory gives the profile's names, and the
demo's four replicas each get their four MIG devices on one parent GPU."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from simnode.fake import discover_node
from simnode.profiles import BUILTIN_PROFILES, load_profile

from dra_gpu.common.exit_codes import EXIT_INVALID, EXIT_OK
from dra_gpu.controller.commands import explain_inputs
from dra_gpu.controller.inputs import Inputs
from dra_gpu.model import nvidia_compat
from dra_gpu.model.device_classes import chart_device_classes
from dra_gpu.node.slices import build_slices
from tests.simnode_support import (
    devdir_for,
    libcache,  # noqa: F401 - fixture
    library,
    needs_root,
    needs_toolchain,
    nvml_h,  # noqa: F401 - fixture
    run_child,
)

PROFILE = "dgx-a100-40gb-mig"
DRIVER = nvidia_compat.DRIVER_NAME  # gpu.nvidia.com: the demo's attribute domain
# mig-parted-config.yaml, config half-balanced: devices 0-3 get these, devices 4-7 MIG off.
HALF_BALANCED = Counter({"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1})
MIB, GIB = 1 << 20, 1 << 30
COMPUTE_SLICES = 7  # of an A100 (MIG user guide)
DRA_GPU = shutil.which("dra-gpu") or str(Path(sys.executable).with_name("dra-gpu"))


def nvidia_profile_name(slices: int, memory_mib: int, total_bytes: int) -> str:
    """The name NVIDIA's DRA driver gives a GPU-instance profile (go-nvlib's mig_profile.go): the
    profile's share of the GPU's memory rounded up to eighths, times the GPU's memory in whole
    GiB (rounded up), rounded to GB. Go's math.Round takes halves away from zero."""
    share = math.ceil(memory_mib * MIB / total_bytes * 8) / 8
    return f"{slices}g.{math.floor(share * math.ceil(total_bytes / GIB) + 0.5)}gb"


# ---------------------------------------------------------------- the profile


@pytest.mark.parametrize("profile", [p for p in BUILTIN_PROFILES if load_profile(p).mig_profiles])
def test_nvidias_name_for_each_profile_is_the_profiles_own(profile: str) -> None:
    """Our simulated NVML names a profile as the YAML does; NVIDIA's driver derives the name from
    memoryMiB and the GPU's total: both must agree, or a demo's `profile == '1g.5gb'` matches
    nothing on one of them."""
    node = load_profile(profile)
    totals = {g.memory_mib for g in node.gpus if g.mig_capable}
    assert totals, f"{profile}: MIG profiles but no MIG-capable GPU"
    for total in totals:
        derived = {
            name: nvidia_profile_name(spec.slice_count, spec.memory_mib, total * MIB)
            for name, spec in node.mig_profiles.items()
        }
        assert derived == {name: name for name in node.mig_profiles}, (profile, total)


def test_the_a100_40gb_profiles_are_the_demos() -> None:
    node = load_profile(PROFILE)
    names = {
        nvidia_profile_name(s.slice_count, s.memory_mib, node.gpus[0].memory_mib * MIB)
        for s in node.mig_profiles.values()
    }
    assert set(HALF_BALANCED) <= names


def test_half_balanced_on_gpus_0_to_3_whole_gpus_4_to_7() -> None:
    node = load_profile(PROFILE)
    assert len(node.gpus) == 8 and len(node.nvswitches) == 6
    for g in node.gpus:
        assert g.name == "NVIDIA A100-SXM4-40GB" and g.memory_mib == 40960 and g.mig_capable
        # NVLink 3: 12 links a GPU, 2 to each NVSwitch.
        assert sorted(link.remote for link in g.nvlinks) == sorted(node.nvswitches)
        assert sum(link.links for link in g.nvlinks) == g.nvlink_count == 12
        if g.index < 4:
            assert g.mig_enabled
            assert Counter(i.profile for i in g.mig_instances) == HALF_BALANCED
            specs = [node.mig_profiles[i.profile] for i in g.mig_instances]
            assert sum(s.slice_count for s in specs) == COMPUTE_SLICES
            # Memory slices: no two overlap (the loader checks), all eight in use.
            assert sum(s.placement_size for s in specs) == 8
        else:
            assert not g.mig_enabled and not g.mig_instances


# ---------------------------------------------------------------- discovery and slices


def test_discovery_shows_4_whole_gpus_and_16_mig_devices() -> None:
    node = load_profile(PROFILE)
    inv = discover_node("node-a", PROFILE)
    whole = [g for g in inv.gpus if not g.mig_enabled]
    parents = [g for g in inv.gpus if g.mig_enabled]
    assert [g.index for g in whole] == [4, 5, 6, 7]
    assert [g.index for g in parents] == [0, 1, 2, 3]
    assert sum(len(g.mig_devices) for g in parents) == 16
    for g in parents:
        assert Counter(m.profile for m in g.mig_devices) == HALF_BALANCED
        for m in g.mig_devices:
            spec = node.mig_profiles[m.profile]
            assert (m.gi_profile_id, m.placement_size) == (spec.profile_id, spec.placement_size)
            assert m.placement_start in spec.placements
            assert m.memory_bytes == spec.memory_mib * MIB
            assert m.multiprocessors == spec.multiprocessors
    # The nvidia-smi profile IDs of the demo's profiles.
    ids = {m.profile: m.gi_profile_id for g in parents for m in g.mig_devices}
    assert ids == {"1g.5gb": 19, "2g.10gb": 14, "3g.20gb": 9}


def _attr(dev: dict[str, Any], name: str) -> Any:
    (value,) = dev["attributes"][name].values()
    return value


def node_slices() -> list[dict[str, Any]]:
    return build_slices(discover_node("node-a", PROFILE), DRIVER)


def test_slices_as_gpu_nvidia_com() -> None:
    devs = [d for s in node_slices() for d in s["spec"].get("devices") or []]
    assert {s["spec"]["driver"] for s in node_slices()} == {DRIVER}
    gpus = [d for d in devs if _attr(d, "type") == "gpu"]
    migs = [d for d in devs if _attr(d, "type") == "mig"]
    assert len(gpus) == 4 and len(migs) == 16
    assert {d["capacity"]["memory"]["value"] for d in gpus} == {"40Gi"}
    by_parent: dict[str, Counter[str]] = {}
    for m in migs:
        by_parent.setdefault(_attr(m, "parentUUID"), Counter())[_attr(m, "profile")] += 1
        assert _attr(m, "productName") == "NVIDIA A100-SXM4-40GB"
    assert len(by_parent) == 4 and all(c == HALF_BALANCED for c in by_parent.values())
    assert {_attr(m, "profile"): m["capacity"]["memory"]["value"] for m in migs} == {
        "1g.5gb": "4864Mi",
        "2g.10gb": "9856Mi",
        "3g.20gb": "19968Mi",
    }


# ---------------------------------------------------------------- gpu-test4


def gpu_test4_spec() -> dict[str, Any]:
    """What gpu-test4.yaml's ResourceClaimTemplate asks: four MIG devices of class mig.nvidia.com
    selected by profile, all on one physical GPU."""
    wanted = [("mig-1g-5gb-0", "1g.5gb"), ("mig-1g-5gb-1", "1g.5gb"), ("mig-2g-10gb", "2g.10gb")]
    wanted.append(("mig-3g-20gb", "3g.20gb"))
    requests = [
        {
            "name": name,
            "exactly": {
                "deviceClassName": "mig.nvidia.com",
                "selectors": [{"cel": {"expression": f"device.attributes['{DRIVER}'].profile == '{p}'"}}],
            },
        }
        for name, p in wanted
    ]
    return {
        "devices": {
            "requests": requests,
            "constraints": [{"requests": [], "matchAttribute": f"{DRIVER}/parentUUID"}],
        }
    }


def replica_claim(n: int) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "gpu-test4", "name": f"pod-{n}-mig-devices"},
        "spec": gpu_test4_spec(),
    }


def test_gpu_test4s_four_replicas_each_get_one_parent_and_a_fifth_does_not() -> None:
    """The Deployment's 4 replicas, one claim each, allocated one after another as the scheduler
    would: each on a parent of its own, the four devices the ones asked for; a fifth claim finds
    no GPU left with the layout."""
    slices = node_slices()
    devices = {d["name"]: d for s in slices for d in s["spec"].get("devices") or []}
    classes = chart_device_classes(DRIVER)
    allocated: list[dict[str, Any]] = []
    parents = []
    for n in range(4):
        inputs = Inputs(slices=slices, classes=classes, claims=[*allocated, replica_claim(n)])
        (entry,) = explain_inputs(inputs, DRIVER, nvidia_compatible=True)["claims"]
        assert entry["allocatable"], entry["reason"]
        results = entry["results"]
        got = {r["request"]: _attr(devices[r["device"]], "profile") for r in results}
        assert got == {
            "mig-1g-5gb-0": "1g.5gb",
            "mig-1g-5gb-1": "1g.5gb",
            "mig-2g-10gb": "2g.10gb",
            "mig-3g-20gb": "3g.20gb",
        }
        (parent,) = {_attr(devices[r["device"]], "parentUUID") for r in results}
        parents.append(parent)
        claim = replica_claim(n)
        claim["status"] = {"allocation": {"devices": {"results": results}}}
        allocated.append(claim)
    assert len(set(parents)) == 4
    inputs = Inputs(slices=slices, classes=classes, claims=[*allocated, replica_claim(4)])
    (entry,) = explain_inputs(inputs, DRIVER, nvidia_compatible=True)["claims"]
    assert not entry["allocatable"] and entry["reason"]


def test_the_claim_template_is_feasible_as_a_user_checks_it(tmp_path: Path) -> None:
    """`dra-gpu validate --nvidia-compatible` on a directory with the demo's ResourceClaimTemplate
    and the node's slices (the 80GB node's cannot satisfy it); `dra-gpu explain` for one
    replica's claim: one parent, four devices."""
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"namespace": "gpu-test4", "name": "mig-devices"},
        "spec": {"spec": gpu_test4_spec()},
    }

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([DRA_GPU, *args], capture_output=True, text=True, timeout=60, check=False)
        assert "Traceback" not in out.stdout + out.stderr
        return out

    verdicts = {}
    for profile in (PROFILE, "dgx-a100-mig"):
        d = tmp_path / profile
        d.mkdir()
        (d / "slices.yaml").write_text(
            yaml.safe_dump_all(build_slices(discover_node("node-a", profile), DRIVER))
        )
        (d / "template.yaml").write_text(yaml.safe_dump(template))
        out = run("validate", "--nvidia-compatible", "-f", str(d))
        assert "feasibility not checked" not in out.stderr
        verdicts[profile] = (out.returncode, out.stdout.strip().removeprefix(f"{d / 'template.yaml'}: "))
    assert verdicts[PROFILE] == (EXIT_OK, "ResourceClaimTemplate/mig-devices: runs on dra-gpu")
    code, text = verdicts["dgx-a100-mig"]
    assert code == EXIT_INVALID and "can never be satisfied by the published devices" in text, text

    slices = tmp_path / PROFILE / "slices.yaml"
    (tmp_path / "claim.yaml").write_text(yaml.safe_dump(replica_claim(0)))
    out = run(
        "explain", "--nvidia-compatible", "-f", str(slices), "-f", str(tmp_path / "claim.yaml"), "-o", "json"
    )
    assert out.returncode == EXIT_OK, out.stderr
    (entry,) = json.loads(out.stdout)["claims"]
    assert entry["allocatable"] and len(entry["devices"]) == 4
    assert len({d.split("-mig-")[0] for d in entry["devices"]}) == 1


# ---------------------------------------------------------------- the C library


NVML_ANSWERS = """
from simnode.fake import simulated_nvml
from simnode.profiles import load_profile
from dra_gpu.discovery.nvml_discovery import discover
pynvml.nvmlInit()
gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
total = pynvml.nvmlDeviceGetMemoryInfo(gpu).total
profiles = []
for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
    try:
        info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu, index)
    except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
        continue
    name = info.name.decode() if isinstance(info.name, bytes) else str(info.name)
    profiles.append((name, int(info.id), int(info.sliceCount), int(info.memorySizeMB)))
fake, pcie_root = simulated_nvml(load_profile(sys.argv[2]))
real = discover(pynvml, "node-a", pcie_root)
out((total, profiles, real, discover(fake, "node-a", pcie_root)))
"""


@needs_toolchain
@needs_root
def test_the_c_library_answers_what_nvidias_driver_names_alike(libcache: Path, tmp_path: Path) -> None:  # noqa: F811
    """Through the simulated libnvidia-ml.so.1: the GPU's total memory and each GPU-instance
    profile's memorySizeMB give, by NVIDIA's rule, the name NVML reports; discovery over it sees
    the same node as over the in-process fake, the pre-made MIG devices included."""
    lib = library(libcache, PROFILE)
    total, profiles, real, fake = run_child(lib, devdir_for(tmp_path / "dev", PROFILE), NVML_ANSWERS, PROFILE)
    assert total == 40960 * MIB
    assert {name.removeprefix("MIG ") for name, *_ in profiles} >= set(HALF_BALANCED)
    for name, _, slices, memory_mib in profiles:
        assert nvidia_profile_name(slices, memory_mib, total) == name.removeprefix("MIG "), name
    ids = {name.removeprefix("MIG "): pid for name, pid, *_ in profiles}
    assert (ids["1g.5gb"], ids["2g.10gb"], ids["3g.20gb"]) == (19, 14, 9)
    assert real == fake
    assert sum(len(g.mig_devices) for g in real.gpus) == 16
