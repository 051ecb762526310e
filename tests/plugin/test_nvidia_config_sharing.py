"""Claims configured with NVIDIA's resource.nvidia.com/v1beta1 prepared by the plugin: the same
sharing as gpu.dra-gpu.io/v1alpha1 (the simulated driver's MPS daemon and nvidia-smi), and
`defaultPerDevicePinnedMemoryLimit` end to end: a key is a device UUID or an index into the sorted
UUIDs of the devices its config entry applies to; a key naming none of them fails the prepare."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from typing import Any

import pytest

from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.model.config import NVIDIA_API_VERSION
from dra_gpu.plugin.plan import PrepareError
from plugin.conftest import DRIVER, PluginCore, claim, gpu_names, mig_names, prepare_claim

pytestmark = pytest.mark.skipif(
    subprocess.run(["which", "cc"], capture_output=True).returncode != 0, reason="needs cc"
)


def ref_of(c: dict[str, Any]) -> ClaimRef:
    m = c["metadata"]
    return ClaimRef(m["namespace"], m["uid"], m["name"])


def entry(
    sharing: dict[str, Any] | None, kind: str = "GpuConfig", requests: list[str] | None = None
) -> dict[str, Any]:
    params: dict[str, Any] = {"apiVersion": NVIDIA_API_VERSION, "kind": kind}
    if sharing is not None:
        params["sharing"] = sharing
    return {
        "source": "FromClaim",
        "requests": requests or [],
        "opaque": {"driver": DRIVER, "parameters": params},
    }


def mps(**config: Any) -> dict[str, Any]:
    return {"strategy": "MPS", "mpsConfig": config}


def uuids_of(core: PluginCore, names: list[str]) -> dict[str, str]:
    return {g.device_name: g.uuid for g in core.inventory.gpus if g.device_name in names}


def ask(core: PluginCore, pipe_dir: str, *commands: str) -> list[str]:
    binary = core.driver_root / "usr/bin/nvidia-cuda-mps-control"
    out = subprocess.run(
        [str(binary)],
        input="".join(f"{c}\n" for c in commands),
        env={"CUDA_MPS_PIPE_DIRECTORY": pipe_dir},
        capture_output=True,
        text=True,
        timeout=5,
        check=False,
    )
    return out.stdout.splitlines()


def spec_of(core: PluginCore, c: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads(core.cdi.path(c["metadata"]["uid"]).read_text())
    return spec


def env_of(device: dict[str, Any]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in device["containerEdits"].get("env", []))


def pipes(core: PluginCore, c: dict[str, Any]) -> set[str]:
    """The client pipe directories the claim's CDI devices get."""
    return {
        m["hostPath"]
        for d in spec_of(core, c)["devices"]
        for m in d["containerEdits"].get("mounts", [])
        if m["containerPath"] == "/tmp/nvidia-mps"
    }


def test_per_device_limits_by_index_and_uuid_override_the_default_in_daemon_and_env(core: PluginCore) -> None:
    names = gpu_names(core)[:3]
    uuids = uuids_of(core, names)
    ordered = sorted(uuids.values())  # index 1: the middle UUID, whatever the device names' order
    c = claim(
        str(uuid.uuid4()),
        names,
        config=[
            entry(
                mps(
                    defaultActiveThreadPercentage=50,
                    defaultPinnedDeviceMemoryLimit="10Gi",
                    defaultPerDevicePinnedMemoryLimit={"1": "4Gi", ordered[2]: "2Gi"},
                )
            )
        ],
    )
    core.add(c)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    want = {ordered[0]: "10240M", ordered[1]: "4096M", ordered[2]: "2048M"}
    (pipe,) = pipes(core, c)  # one daemon for the config's three GPUs
    asked = ask(core, pipe, *(f"get_default_device_pinned_mem_limit {u}" for u in ordered))
    assert asked == [want[u] for u in ordered]
    assert ask(core, pipe, "get_default_active_thread_percentage") == ["50.0"]
    limits = sorted(env_of(d)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] for d in spec_of(core, c)["devices"])
    assert limits == sorted(f"{u}={m}" for u, m in want.items())
    (record,) = core.checkpoint.records()
    assert record.sharing is not None
    (daemon,) = record.sharing["mps"]
    assert daemon["pinnedMemoryLimits"] == want
    asyncio.run(core.preparer.unprepare(ref_of(c)))


def test_per_device_limits_without_a_default_limit_only_the_named_device(core: PluginCore) -> None:
    names = gpu_names(core)[:2]
    ordered = sorted(uuids_of(core, names).values())
    c = claim(str(uuid.uuid4()), names, config=[entry(mps(defaultPerDevicePinnedMemoryLimit={"0": "1Gi"}))])
    core.add(c)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    (record,) = core.checkpoint.records()
    assert record.sharing is not None
    assert record.sharing["mps"][0]["pinnedMemoryLimits"] == {ordered[0]: "1024M"}
    envs = [env_of(d) for d in spec_of(core, c)["devices"]]
    assert sorted(e.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "") for e in envs) == ["", f"{ordered[0]}=1024M"]
    asyncio.run(core.preparer.unprepare(ref_of(c)))


def test_an_index_counts_the_devices_of_its_own_config_entry(core: PluginCore) -> None:
    """Two entries with the same content, each for one request: index 0 is each entry's first
    device (NVIDIA runs a daemon per entry; dra-gpu one for equal configs, with both limits)."""
    g0, g1 = gpu_names(core)[:2]
    u = uuids_of(core, [g0, g1])
    same = mps(defaultPerDevicePinnedMemoryLimit={"0": "3Gi"})
    c = claim(
        str(uuid.uuid4()),
        [g0, g1],
        requests=["a", "b"],
        config=[entry(same, requests=["a"]), entry(same, requests=["b"])],
    )
    core.add(c)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    (record,) = core.checkpoint.records()
    assert record.sharing is not None
    limits = {k: v for d in record.sharing["mps"] for k, v in d["pinnedMemoryLimits"].items()}
    assert limits == {u[g0]: "3072M", u[g1]: "3072M"}
    asyncio.run(core.preparer.unprepare(ref_of(c)))


@pytest.mark.parametrize("key", ["2", "GPU-00000000-0000-0000-0000-000000000000"])
def test_a_key_naming_no_device_of_the_config_fails_prepare_naming_claim_config_and_key(
    core: PluginCore, key: str
) -> None:
    names = gpu_names(core)[:2]
    c = claim(
        str(uuid.uuid4()),
        names,
        config=[entry(None), entry(mps(defaultPerDevicePinnedMemoryLimit={key: "1Gi"}))],
    )
    core.add(c)
    with pytest.raises(PrepareError) as err:
        asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    message = str(err.value)
    assert f"claim {ref_of(c)}: " in message
    assert (
        "status.allocation.devices.config[1].opaque.parameters.sharing.mpsConfig."
        f"defaultPerDevicePinnedMemoryLimit[{key}]: names none of the 2 devices" in message
    ), message
    assert core.checkpoint.records() == []
    assert not core.cdi.path(c["metadata"]["uid"]).exists()
    assert core.preparer.sharing is not None and core.preparer.sharing.mps.owned() == []


def test_two_keys_naming_one_device_fail_prepare(core: PluginCore) -> None:
    g0 = gpu_names(core)[0]
    u = uuids_of(core, [g0])[g0]
    c = claim(
        str(uuid.uuid4()), [g0], config=[entry(mps(defaultPerDevicePinnedMemoryLimit={"0": "1Gi", u: "2Gi"}))]
    )
    core.add(c)
    with pytest.raises(PrepareError, match=f"names device {u}, which key"):
        asyncio.run(prepare_claim(core.preparer, ref_of(c)))


def test_nvidia_time_slicing_sets_the_interval_and_a_mig_time_slicing_config_is_exclusive(
    core: PluginCore,
) -> None:
    g0 = gpu_names(core)[0]
    u = uuids_of(core, [g0])[g0]
    c = claim(
        str(uuid.uuid4()),
        [g0],
        config=[entry({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})],
    )
    core.add(c)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    calls = (core.root / "devroot" / "dev" / "nvidia-smi.calls").read_text().splitlines()
    assert calls == [f"compute-policy -i {u} --set-timeslice 3"]
    asyncio.run(core.preparer.unprepare(ref_of(c)))
    m0 = mig_names(core)[0]
    c = claim(str(uuid.uuid4()), [m0], config=[entry({"strategy": "TimeSlicing"}, kind="MigDeviceConfig")])
    core.add(c)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    (record,) = core.checkpoint.records()
    assert record.sharing is None  # nothing applied: the MIG device's containers time-share it anyway
    (device,) = spec_of(core, c)["devices"]
    assert env_of(device)["DRA_GPU_SHARING_STRATEGY"] == "Exclusive"
