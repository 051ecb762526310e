"""NVML -> Inventory.

`discover()` takes the `pynvml` module (bound to the driver root's libnvidia-ml.so.1 on a real
and a simulated node alike: `dra_gpu.node.backend`) or anything shaped like it (unit tests'
`FakeNvml`). Optional data that a GPU does
not support is left out; a GPU whose core calls fail is left out with a log line naming it.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dra_gpu.discovery.nvlink_domains import assign_domains
from dra_gpu.discovery.nvml_compat import gpu_instance_profile_info_by_id
from dra_gpu.model.inventory import FabricInfo, Gpu, Inventory, MigDevice, MigProfile, NvLink

log = logging.getLogger(__name__)

# NVML's enums -> the names NVIDIA's own tools (go-nvlib) give them, which NVIDIA's DRA driver
# publishes: a selector written for it (`architecture == "Ada Lovelace"`) matches here too.
ARCHITECTURE_NAMES = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada Lovelace",
    9: "Hopper",
    10: "Blackwell",
    13: "Rubin",
}
BRAND_NAMES = {
    0: "Unknown",
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "Grid",
    5: "GeForce",
    6: "Titan",
    7: "NvidiaVApps",
    8: "NvidiaVPC",
    9: "NvidiaVCS",
    10: "NvidiaVWS",
    11: "NvidiaCloudGaming",
    12: "QuadroRTX",
    13: "NvidiaRTX",
    14: "Nvidia",
    15: "GeForceRTX",
    16: "TitanRTX",
}
# nvmlDeviceAddressingMode_t -> go-nvlib's names, as NVIDIA's driver publishes `addressingMode`.
ADDRESSING_MODE_NAMES = {0: "None", 1: "HMM", 2: "ATS"}
# GPU-instance profile indices dynamic MIG offers: the plain ones and REV2 (1g with double
# memory); the media-extension variants (+me, -me, +gfx) would need names of their own.
DYNAMIC_PROFILE_INDICES = (0x0, 0x9, 0x1, 0x2, 0x3, 0x6, 0x4, 0x5)
TOPOLOGY_NAMES = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
FABRIC_STATE_COMPLETED = 3

PcieRootResolver = Callable[[str], "str | None"]


class NvmlUnavailableError(RuntimeError):
    """NVML could not be initialised (no driver or no library on this machine)."""


def normalise_pci_bus_id(raw: str | bytes) -> str:
    """NVML's "00000000:18:00.0" -> the sysfs / Kubernetes form "0000:18:00.0"."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    dom, bus, rest = text.strip().split(":")
    dev, fn = rest.split(".")
    return f"{int(dom, 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{int(fn, 16):x}"


def sysfs_pcie_root(sysfs: str = "/sys") -> PcieRootResolver:
    """The PCIe root complex ("pci0000:00") of a device, from its sysfs path."""

    # <sysfs>/bus/pci/devices/<bus id> links to <sysfs>/devices/<root complex>/[bridges/]<bus id>.
    devices = Path(os.path.realpath(Path(sysfs) / "devices"))

    def resolve(pci_bus_id: str) -> str | None:
        try:
            real = Path(os.path.realpath(Path(sysfs) / "bus" / "pci" / "devices" / pci_bus_id))
            first = real.relative_to(devices).parts[0]
        except (OSError, ValueError, IndexError):
            return None
        return first if first.startswith("pci") and ":" in first else None

    return resolve


class _Discovery:
    def __init__(self, nvml: Any, node_name: str, pcie_root: PcieRootResolver, dynamic_mig: bool) -> None:
        self.nvml = nvml
        self.dynamic_mig = dynamic_mig
        self.node_name = node_name
        self.pcie_root = pcie_root

    def optional(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """An NVML call whose failure only drops one attribute."""
        try:
            return fn(*args)
        except self.nvml.NVMLError as exc:
            log.debug("nvml optional call failed call=%s error=%s", what, exc)
            return None

    def run(self) -> Inventory:
        nv = self.nvml
        driver = self.optional("driverVersion", nv.nvmlSystemGetDriverVersion)
        cuda = self.optional("cudaDriverVersion", nv.nvmlSystemGetCudaDriverVersion)
        inv = Inventory(node_name=self.node_name, driver_version=driver, cuda_driver_version=cuda)
        handles: dict[int, Any] = {}
        for index in range(nv.nvmlDeviceGetCount()):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                gpu = self.core(index, handle)
            except nv.NVMLError as exc:
                reason = f"GPU {index}: left out, NVML core call failed: {exc}"
                log.error("gpu skipped index=%d error=%r", index, str(exc))
                inv.skipped.append(reason)
                continue
            self.details(gpu, handle)
            inv.gpus.append(gpu)
            handles[gpu.index] = handle
        self.topology(inv, handles)
        assign_domains(inv)
        return inv

    def core(self, index: int, h: Any) -> Gpu:
        nv = self.nvml
        pci = nv.nvmlDeviceGetPciInfo(h)
        return Gpu(
            index=index,
            minor=nv.nvmlDeviceGetMinorNumber(h),
            uuid=nv.nvmlDeviceGetUUID(h),
            product_name=nv.nvmlDeviceGetName(h),
            pci_bus_id=normalise_pci_bus_id(pci.busId),
        )

    def details(self, gpu: Gpu, h: Any) -> None:
        nv = self.nvml
        brand = self.optional("brand", nv.nvmlDeviceGetBrand, h)
        gpu.brand = None if brand is None else BRAND_NAMES.get(brand, f"Brand{brand}")
        arch = self.optional("architecture", nv.nvmlDeviceGetArchitecture, h)
        gpu.architecture = None if arch is None else ARCHITECTURE_NAMES.get(arch, f"Arch{arch}")
        cc = self.optional("computeCapability", nv.nvmlDeviceGetCudaComputeCapability, h)
        gpu.cuda_compute_capability = None if cc is None else (int(cc[0]), int(cc[1]))
        mem = self.optional("memory", nv.nvmlDeviceGetMemoryInfo, h)
        gpu.memory_bytes = None if mem is None else int(mem.total)
        attrs = self.optional("attributes", nv.nvmlDeviceGetAttributes, h)
        if attrs is not None and attrs.multiprocessorCount:
            gpu.multiprocessors = int(attrs.multiprocessorCount)
        # NVML 13 (driver 580+) only; older libraries lack the function (FunctionNotFound).
        get_mode = getattr(nv, "nvmlDeviceGetAddressingMode", None)
        mode_id = None if get_mode is None else self.optional("addressingMode", get_mode, h)
        gpu.addressing_mode = ADDRESSING_MODE_NAMES.get(mode_id) if isinstance(mode_id, int) else None
        numa = self.optional("numaNode", nv.nvmlDeviceGetNumaNodeId, h)
        gpu.numa_node = numa if isinstance(numa, int) and numa >= 0 else None
        gpu.pcie_root = self.pcie_root(gpu.pci_bus_id)
        mode = self.optional("migMode", nv.nvmlDeviceGetMigMode, h)
        gpu.mig_enabled = bool(mode and mode[0] == nv.NVML_DEVICE_MIG_ENABLE)
        if gpu.mig_enabled:
            gpu.mig_profiles = self.mig_profiles(gpu, h)
            gpu.dynamic_mig = self.dynamic_mig and bool(gpu.mig_profiles)
            gpu.mig_devices = self.mig_devices(gpu, h)
        gpu.nvlinks = self.nvlinks(h)
        gpu.fabric = self.fabric(h)

    def mig_devices(self, gpu: Gpu, h: Any) -> list[MigDevice]:
        nv = self.nvml
        count = self.optional("maxMigDeviceCount", nv.nvmlDeviceGetMaxMigDeviceCount, h) or 0
        out = []
        for i in range(count):
            try:
                mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
            except nv.NVMLError_NotFound:
                continue
            except nv.NVMLError as exc:
                log.warning("mig device unreadable gpu=%s slot=%d error=%r", gpu.uuid, i, str(exc))
                continue
            try:
                out.append(self.mig_device(h, mig))
            except nv.NVMLError as exc:
                log.warning("mig device skipped gpu=%s slot=%d error=%r", gpu.uuid, i, str(exc))
        if not out and not gpu.dynamic_mig:
            log.warning("mig enabled but no mig devices gpu=%s: its capacity is stranded", gpu.uuid)
        return sorted(out, key=lambda m: (m.placement_start, m.gpu_instance_id))

    def mig_profiles(self, gpu: Gpu, h: Any) -> list[MigProfile]:
        """The GPU-instance profiles NVML offers and their possible placements."""
        nv = self.nvml
        out = []
        for index in DYNAMIC_PROFILE_INDICES:
            try:
                info = nv.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
            except (nv.NVMLError_NotSupported, nv.NVMLError_InvalidArgument):
                continue  # not a profile of this GPU
            except nv.NVMLError as exc:
                log.warning("mig profile unreadable gpu=%s index=%d error=%r", gpu.uuid, index, str(exc))
                continue
            try:
                count = ctypes.c_uint(0)
                nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, info.id, None, ctypes.byref(count))
                placements = (nv.c_nvmlGpuInstancePlacement_t * max(count.value, 1))()
                nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, info.id, placements, ctypes.byref(count))
            except nv.NVMLError as exc:
                log.warning(
                    "mig placements unreadable gpu=%s profile=%d error=%r", gpu.uuid, info.id, str(exc)
                )
                continue
            found = [(int(p.start), int(p.size)) for p in placements[: count.value]]
            if not found:
                continue
            name = info.name.decode() if isinstance(info.name, bytes) else str(info.name)
            out.append(
                MigProfile(
                    name=name.removeprefix("MIG ").strip(),
                    profile_id=int(info.id),
                    compute_slices=int(info.sliceCount),
                    memory_slices=found[0][1],
                    placements=tuple(sorted(start for start, _ in found)),
                    memory_bytes=int(info.memorySizeMB) << 20,
                    multiprocessors=int(info.multiprocessorCount),
                    copy_engines=int(info.copyEngineCount),
                    decoders=int(info.decoderCount),
                    encoders=int(info.encoderCount),
                    jpeg_engines=int(info.jpegCount),
                    ofa_engines=int(info.ofaCount),
                )
            )
        return out

    def mig_device(self, parent: Any, mig: Any) -> MigDevice:
        nv = self.nvml
        gi_id = nv.nvmlDeviceGetGpuInstanceId(mig)
        ci_id = nv.nvmlDeviceGetComputeInstanceId(mig)
        gi_info = nv.nvmlGpuInstanceGetInfo(nv.nvmlDeviceGetGpuInstanceById(parent, gi_id))
        prof = gpu_instance_profile_info_by_id(nv, parent, int(gi_info.profileId))
        name = prof.name.decode() if isinstance(prof.name, bytes) else str(prof.name)
        return MigDevice(
            uuid=nv.nvmlDeviceGetUUID(mig),
            profile=name.removeprefix("MIG ").strip(),
            gpu_instance_id=int(gi_id),
            compute_instance_id=int(ci_id),
            gi_profile_id=int(gi_info.profileId),
            placement_start=int(gi_info.placement.start),
            placement_size=int(gi_info.placement.size),
            memory_bytes=int(prof.memorySizeMB) << 20,
            multiprocessors=int(prof.multiprocessorCount),
            copy_engines=int(prof.copyEngineCount),
            decoders=int(prof.decoderCount),
            encoders=int(prof.encoderCount),
            jpeg_engines=int(prof.jpegCount),
            ofa_engines=int(prof.ofaCount),
        )

    def nvlinks(self, h: Any) -> list[NvLink]:
        nv = self.nvml
        links = []
        for link in range(int(nv.NVML_NVLINK_MAX_LINKS)):
            try:
                state = nv.nvmlDeviceGetNvLinkState(h, link)
            except nv.NVMLError_NotSupported:
                if link == 0:
                    return []  # no NVLink on this GPU
                continue
            except nv.NVMLError:
                continue  # past the GPU's link count: real drivers say InvalidArgument
            if state != nv.NVML_FEATURE_ENABLED:
                continue
            try:
                remote = nv.nvmlDeviceGetNvLinkRemotePciInfo(h, link)
            except nv.NVMLError as exc:
                log.warning("nvlink remote unreadable link=%d error=%r", link, str(exc))
                continue
            kind = self.optional("remoteType", nv.nvmlDeviceGetNvLinkRemoteDeviceType, h, link)
            links.append(
                NvLink(
                    link=link,
                    remote_pci_bus_id=normalise_pci_bus_id(remote.busId),
                    remote_is_gpu=kind == nv.NVML_NVLINK_DEVICE_TYPE_GPU,
                )
            )
        return links

    def fabric(self, h: Any) -> FabricInfo | None:
        nv = self.nvml
        info = nv.c_nvmlGpuFabricInfoV_t()
        info.version = nv.nvmlGpuFabricInfo_v2
        try:
            nv.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info))
        except nv.NVMLError:
            return None
        raw = bytes(info.clusterUuid)
        if info.state != FABRIC_STATE_COMPLETED or info.status != 0 or not any(raw):
            return None
        hexs = raw.hex()
        cluster = f"{hexs[:8]}-{hexs[8:12]}-{hexs[12:16]}-{hexs[16:20]}-{hexs[20:]}"
        return FabricInfo(cluster_uuid=cluster, clique_id=int(info.cliqueId))

    def topology(self, inv: Inventory, handles: dict[int, Any]) -> None:
        nv = self.nvml
        for a in inv.gpus:
            for b in inv.gpus:
                if a.index >= b.index:
                    continue
                level = self.optional(
                    "topology", nv.nvmlDeviceGetTopologyCommonAncestor, handles[a.index], handles[b.index]
                )
                if level is not None:
                    name = TOPOLOGY_NAMES.get(int(level), "SYS")
                    inv.pcie_topology[(a.index, b.index)] = name
                    inv.pcie_topology[(b.index, a.index)] = name


def discover(
    nvml: Any, node_name: str, pcie_root: PcieRootResolver | None = None, dynamic_mig: bool = False
) -> Inventory:
    """Build the node's Inventory through `nvml` (pynvml, or a unit test's FakeNvml).

    Initialises NVML for the duration of the call and shuts it down again (NVML's init is
    reference-counted, so a long-lived caller that holds its own init keeps its handles).
    `dynamic_mig`: GPUs in MIG mode are published as every placement NVML lists (see slices).
    """
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise NvmlUnavailableError(f"NVML is not available: {exc}") from exc
    try:
        return _Discovery(nvml, node_name, pcie_root or sysfs_pcie_root(), dynamic_mig).run()
    finally:
        nvml.nvmlShutdown()
