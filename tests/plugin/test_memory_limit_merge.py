"""What NVIDIA's `apply-cuda-memory-limits` hook sets for a container given several prepared
devices, with their CDI edits merged as the runtime merges them: devices in the order the pod spec
gives, a later device's variable replacing an earlier one of the same name, then every device's
hook run with the one resulting environment (the hook reads `NVIDIA_GPU_MEMORY_LIMIT` from the
container and sets it on each of its `--gpu-id`s; toolkit 1.20.2)."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import uuid
from typing import Any

import pytest

from dra_gpu.plugin.memory_limits import HOOK, LIMIT_ENV, REQUEST_ENV
from plugin.conftest import PluginCore, claim, gpu_names, prepare_claim
from plugin.test_sharing import driver_limits, ref_of, uid

pytestmark = pytest.mark.skipif(
    subprocess.run(["which", "cc"], capture_output=True).returncode != 0, reason="needs cc"
)

GIB_MIB = 1024


def container_limits(devices: list[dict[str, Any]]) -> dict[str, int]:
    """GPU UUID -> the limit (MiB) the hooks set on the container's cgroup, for these CDI devices
    in this order."""
    env: dict[str, str] = {}
    for device in devices:
        for entry in device["containerEdits"].get("env", []):
            name, _, value = entry.partition("=")
            env[name] = value  # replaced in place: one variable, the last device's value
    if LIMIT_ENV not in env and REQUEST_ENV not in env:
        return {}  # the hook sets nothing
    limits = {}
    for device in devices:
        for hook in device["containerEdits"].get("hooks", []):
            args = hook["args"]
            if HOOK in args:
                for i, arg in enumerate(args):
                    if arg == "--gpu-id":
                        limits[args[i + 1]] = int(env[LIMIT_ENV])
    return limits


def prepared_devices(core: PluginCore, c: dict) -> list[dict[str, Any]]:
    return json.loads(core.cdi.path(c["metadata"]["uid"]).read_text())["devices"]


def with_shares(c: dict, sizes: list[str | None]) -> dict:
    """A share of each size on the claim's results in turn (None: the result is a whole GPU)."""
    for result, size in zip(c["status"]["allocation"]["devices"]["results"], sizes, strict=True):
        if size is not None:
            result["shareID"], result["consumedCapacity"] = str(uuid.uuid4()), {"memory": size}
    return c


def uuid_of(core: PluginCore, name: str) -> str:
    return next(g.uuid for g in core.inventory.gpus if g.device_name == name)


def test_any_container_of_an_accepted_claim_holds_each_shared_gpu_to_its_share(core: PluginCore) -> None:
    """Two shares of one size on two GPUs and a whole GPU, in one claim: whichever of its devices a
    container is given, in whichever order, each share's GPU is held to exactly its share."""
    assert core.preparer.sharing is not None
    core.preparer.sharing.memory_limits = driver_limits()
    g0, g1, g2 = gpu_names(core)[:3]
    c = with_shares(claim(uid(), [g0, g1, g2]), ["20Gi", "20Gi", None])
    core.add(c)
    asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    devices = prepared_devices(core, c)
    held = {}  # CDI device name -> (its GPU, its share in MiB)
    for result in c["status"]["allocation"]["devices"]["results"]:
        if "shareID" in result:
            name = f"{c['metadata']['uid']}-{result['device']}-{result['shareID']}"
            held[name] = (uuid_of(core, result["device"]), 20 * GIB_MIB)
    assert len(held) == 2 and len(devices) == 3
    seen = 0
    for n in range(1, len(devices) + 1):
        for chosen in itertools.permutations(devices, n):
            expected = dict(held[d["name"]] for d in chosen if d["name"] in held)
            assert container_limits(list(chosen)) == expected, [d["name"] for d in chosen]
            seen += 1
    assert seen == 15  # every order of every subset of the three devices


def test_two_claims_in_one_container_hold_each_gpu_to_one_of_their_own_sizes(core: PluginCore) -> None:
    """What the plugin cannot refuse (it never sees containers): each claim is accepted, and a
    container given both gets one limit, the later device's, on both GPUs. The bound documented in
    `memory_limits`: never more than the largest share the container itself holds."""
    assert core.preparer.sharing is not None
    core.preparer.sharing.memory_limits = driver_limits()
    g0, g1 = gpu_names(core)[:2]
    a = with_shares(claim(uid(), [g0]), ["40Gi"])
    b = with_shares(claim(uid(), [g1]), ["20Gi"])
    for c in (a, b):
        core.add(c)
        asyncio.run(prepare_claim(core.preparer, ref_of(c)))
    (dev_a,) = prepared_devices(core, a)
    (dev_b,) = prepared_devices(core, b)
    u0, u1 = uuid_of(core, g0), uuid_of(core, g1)
    assert container_limits([dev_a]) == {u0: 40 * GIB_MIB}
    assert container_limits([dev_b]) == {u1: 20 * GIB_MIB}
    assert container_limits([dev_a, dev_b]) == {u0: 20 * GIB_MIB, u1: 20 * GIB_MIB}
    assert container_limits([dev_b, dev_a]) == {u0: 40 * GIB_MIB, u1: 40 * GIB_MIB}
