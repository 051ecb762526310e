"""Memory shares enforced by the driver: NVML 13's per-cgroup GPU memory limits.

From driver 580 NVML can cap what the processes of one cgroup allocate on a GPU
(`nvmlDeviceSetMemoryLimits_v1`, cgroup v2 only, whole GPUs only, root only). A memory share's
container gets the share's size as its hard (and soft) limit, for its own cgroup.

Who sets it: NVIDIA's `apply-cuda-memory-limits` hook (nvidia-cdi-hook, toolkit 1.20.1 or newer),
a createRuntime hook the share's CDI device carries. Only the runtime knows a container's cgroup,
and only once the container exists: at prepare there is no container yet (a claim may serve
several containers, each with a cgroup of its own), so the plugin cannot set the limit itself
without watching every container start. CDI's environment replaces a variable of the same name
from the pod spec, so a tenant cannot raise its own limit by setting it.

What the hook can be told (toolkit 1.20.2): `--driver-root`, `--gpu-id` (repeatable, GPU UUIDs)
and `--container-spec`; nothing more. The limit is not an argument: it reads
`NVIDIA_GPU_MEMORY_LIMIT` / `_REQUEST` (MiB) from the container's process environment and sets
that one value on every `--gpu-id` it was given. A share's device therefore carries its own GPU in
its hook, but its limit only in the container-wide environment, where CDI keeps one value per name:
the last device's. No per-device limit and no per-device variable name exists, so a container
holding shares of different sizes would see every share's GPU held to one of them, chosen by the
device order, which the pod spec controls.

So, what the plugin can know it refuses: a claim whose driver-held shares are of different sizes
(`mixed_sizes`; a container may be given all of a claim's devices). Falling back to the MPS limit
instead would let a tenant opt out of the driver's limit by the shape of its claim. Allowed, because
every order and subset holds each GPU to no more than the container holds on it: shares of one
size, on one GPU or several, beside whole GPUs and MPS devices (they set no limit and carry no hook).
Across claims it never sees containers, only the pods that reserve each claim
(`status.reservedFor`): a claim held to another size than a prepared claim one of its pods also
reserves is refused (`sharing.with_pods`, checked with the node's other claims under the journal's
lock, so two claims of one pod prepared at once see each other). What it still cannot see: a claim
prepared for one pod and reserved by another pod later (its recorded pods are those of its
prepare). There the container's GPUs are all held to one of its shares' sizes: at most the largest
share it holds on this node, and a client through MPS is still held by its daemon's pinned limit.

Where the driver, the node or the configuration lacks something, a share is enforced only by its
MPS daemon's pinned-memory limit (cooperative: a client that bypasses MPS is not held to it); the
plugin says which at start, and each share's claim status says which one it got (`MemoryLimit`).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dra_gpu.plugin.cdi_hook import APPLY_CUDA_MEMORY_LIMITS, argv_prefix

log = logging.getLogger(__name__)

HOOK = APPLY_CUDA_MEMORY_LIMITS
LIMIT_ENV = "NVIDIA_GPU_MEMORY_LIMIT"
REQUEST_ENV = "NVIDIA_GPU_MEMORY_REQUEST"
SET_FUNCTION = "nvmlDeviceSetMemoryLimits_v1"
CGROUP_ROOT = Path("/sys/fs/cgroup")
MIB = 1 << 20
# NVML's return codes (nvml.h) the probe tells apart.
NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_NOT_FOUND = 3, 6

DRIVER = "driver"  # the driver holds the container's cgroup to the share
COOPERATIVE = "cooperative"  # only the MPS daemon's pinned-memory limit


@dataclass(frozen=True)
class Enforcement:
    """How a memory share's memory is held on this node, and why."""

    kind: str  # DRIVER or COOPERATIVE
    reason: str

    @property
    def by_driver(self) -> bool:
        return self.kind == DRIVER


@dataclass
class MemoryLimits:
    """Decides once, at start, whether shares get driver limits; then gives each share's edits."""

    enforcement: Enforcement
    hook_path: str | None = None
    host_driver_root: str = "/"
    hook_env: dict[str, str] = field(default_factory=dict)
    unsupported: frozenset[str] = frozenset()  # GPU UUIDs whose driver answered NOT_SUPPORTED

    def for_gpu(self, uuid: str) -> Enforcement:
        if self.enforcement.by_driver and uuid in self.unsupported:
            return Enforcement(COOPERATIVE, f"GPU {uuid} does not support per-cgroup memory limits")
        return self.enforcement

    def edits(self, uuid: str, memory_bytes: int) -> tuple[dict[str, str], list[dict[str, Any]]]:
        """Env and hooks for one share of `memory_bytes` on GPU `uuid` (nothing when cooperative).
        The limit is rounded down to whole MiB: never more than the scheduler gave the share."""
        if not self.for_gpu(uuid).by_driver or self.hook_path is None:
            return {}, []
        mib = str(limit_mib(memory_bytes))
        # The hook's only per-device argument is the GPU; the limit it sets on that GPU is the
        # container's environment value (see the module docstring).
        hook = {
            "hookName": "createRuntime",
            "path": self.hook_path,
            "args": [
                *argv_prefix(self.hook_path),
                HOOK,
                "--driver-root",
                self.host_driver_root,
                "--gpu-id",
                uuid,
            ],
            "env": ["NVIDIA_CTK_DEBUG=false", *(f"{k}={v}" for k, v in sorted(self.hook_env.items()))],
        }
        return {LIMIT_ENV: mib, REQUEST_ENV: mib}, [hook]


def limit_mib(memory_bytes: int) -> int:
    """The limit a share of `memory_bytes` gets, in whole MiB, rounded down (at least 1)."""
    return max(1, memory_bytes // MIB)


def mixed_sizes(shares: list[tuple[str, str, int]]) -> str | None:
    """Why one claim's driver-held shares, (field, quantity, bytes) each, cannot share one
    container-wide limit (None: they can, their limits are all the same)."""
    if not shares:
        return None
    (field_a, size_a, bytes_a), *rest = shares
    owner = field_a.rpartition(": ")[0]  # "claim ns/name (uid ...)", said once
    for field_b, size_b, bytes_b in rest:
        if limit_mib(bytes_b) != limit_mib(bytes_a):
            shown_b = field_b.removeprefix(f"{owner}: ") if owner else field_b
            return (
                f"{field_a} is {size_a} and {shown_b} is {size_b}: NVIDIA's {HOOK} hook holds "
                f"every GPU of a container to one container-wide {LIMIT_ENV}, so a container given "
                f"both would hold one share's GPU to the other's size; on this node the memory "
                f"shares of one claim must be of one size"
            )
    return None


def cgroup_v2(root: Path = CGROUP_ROOT) -> bool:
    """The unified hierarchy is mounted at `root` (what the hook checks before it sets a limit)."""
    return (root / "cgroup.controllers").is_file()


def _probe(nvml: Any, handle: Any, namespace: bytes) -> int | None:
    """NVML's answer to a read of the limits of `namespace` (None: success)."""
    limits = nvml.c_nvmlGetMemoryLimits_v1_t(nameSpace=namespace)
    try:
        nvml.nvmlDeviceGetMemoryLimits_v1(handle, limits)
    except nvml.NVMLError as exc:
        return int(exc.value)
    return None


def detect(
    *,
    mode: str,
    nvml: Any,
    nvml_library: Path,
    driver_version: str | None,
    gpus: Iterable[tuple[str, Any]],
    hook_path: str | None,
    host_driver_root: str,
    hook_env: dict[str, str] | None = None,
    is_cgroup_v2: Callable[[], bool] = cgroup_v2,
    hook_subcommands: frozenset[str] | None = None,
) -> MemoryLimits:
    """What this node can do for memory shares. `mode`: "auto" (driver limits where everything
    needed is there) or "off"; `gpus`: (UUID, NVML handle) of the GPUs that can be shared."""

    def cooperative(reason: str) -> MemoryLimits:
        return MemoryLimits(Enforcement(COOPERATIVE, reason))

    if mode == "off":
        return cooperative("driver memory limits turned off (--driver-memory-limits=off)")
    if not hasattr(ctypes.CDLL(str(nvml_library)), SET_FUNCTION):
        return cooperative(
            f"driver {driver_version or '?'} has no per-cgroup memory limits "
            f"({SET_FUNCTION}: NVML 13, driver 580 or newer)"
        )
    if not is_cgroup_v2():
        return cooperative("the node runs cgroup v1; per-cgroup GPU memory limits need cgroup v2")
    if hook_path is None:
        return cooperative(f"no --cdi-hook-path: NVIDIA's {HOOK} hook sets a container's limit")
    if hook_subcommands is not None and HOOK not in hook_subcommands:
        return cooperative(f"{hook_path} has no {HOOK} hook (NVIDIA's container toolkit 1.20.1 or newer)")
    unsupported = set()
    for uuid, handle in gpus:
        answer = _probe(nvml, handle, bytes(CGROUP_ROOT))
        if answer == NVML_ERROR_NOT_SUPPORTED:
            unsupported.add(uuid)
        elif answer not in (None, NVML_ERROR_NOT_FOUND):
            return cooperative(f"GPU {uuid}: reading its memory limits failed (NVML error {answer})")
    return MemoryLimits(
        Enforcement(DRIVER, f"NVIDIA's {HOOK} hook sets each share's limit for its container's cgroup"),
        hook_path=hook_path,
        host_driver_root=host_driver_root,
        hook_env=dict(hook_env or {}),
        unsupported=frozenset(unsupported),
    )
