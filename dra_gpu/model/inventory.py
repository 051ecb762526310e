"""The shared model: what discovery found on one node.

Discovery produces an Inventory; the slice builder, the kubelet plugin and the controller read it.
Nothing here talks to NVML or Kubernetes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_DRIVER_NAME = "gpu.dra-gpu.io"


@dataclass(frozen=True)
class NvLink:
    """One active NVLink of a GPU."""

    link: int
    remote_pci_bus_id: str
    remote_is_gpu: bool


@dataclass(frozen=True)
class MigDevice:
    """An existing MIG instance (GPU instance + compute instance) of a parent GPU."""

    uuid: str
    profile: str  # e.g. "3g.40gb"
    gpu_instance_id: int
    compute_instance_id: int
    gi_profile_id: int
    placement_start: int
    placement_size: int
    memory_bytes: int
    multiprocessors: int
    copy_engines: int | None = None
    decoders: int | None = None
    encoders: int | None = None
    jpeg_engines: int | None = None
    ofa_engines: int | None = None


@dataclass(frozen=True)
class MigProfile:
    """A GPU-instance profile NVML offers on a GPU and the placements it lists (dynamic MIG)."""

    name: str  # "3g.40gb"
    profile_id: int  # nvidia-smi's profile ID (NVML's info.id)
    compute_slices: int
    memory_slices: int  # placement size
    placements: tuple[int, ...]  # memory-slice starts
    memory_bytes: int
    multiprocessors: int
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpeg_engines: int = 0
    ofa_engines: int = 0


@dataclass(frozen=True)
class MigPlacement:
    """One (profile, placement) of a GPU: a device dynamic MIG publishes and creates on demand."""

    profile: MigProfile
    start: int

    @property
    def slices(self) -> range:
        return range(self.start, self.start + self.profile.memory_slices)


@dataclass(frozen=True)
class FabricInfo:
    """Multi-node NVLink fabric membership (GB200-class systems)."""

    cluster_uuid: str
    clique_id: int


@dataclass
class Gpu:
    """A physical GPU. Optional fields are None when NVML did not support the call."""

    index: int
    minor: int
    uuid: str
    product_name: str
    pci_bus_id: str  # normalised: "0000:18:00.0"
    brand: str | None = None
    architecture: str | None = None
    cuda_compute_capability: tuple[int, int] | None = None
    memory_bytes: int | None = None
    multiprocessors: int | None = None
    numa_node: int | None = None
    addressing_mode: str | None = None  # NVML 13 (driver 580+): ATS, HMM or None
    pcie_root: str | None = None
    mig_enabled: bool = False
    mig_devices: list[MigDevice] = field(default_factory=list)
    mig_profiles: list[MigProfile] = field(default_factory=list)
    # Dynamic MIG: every placement is published and instances are made at prepare.
    dynamic_mig: bool = False
    nvlinks: list[NvLink] = field(default_factory=list)
    fabric: FabricInfo | None = None
    # Filled by domain derivation (discovery.nvlink_domains).
    nvlink_domain: str | None = None
    nvlink_domain_size: int | None = None

    @property
    def device_name(self) -> str:
        """Stable DNS-label name from the PCI address; the NVML index can change across boots."""
        return "gpu-" + self.pci_bus_id.lower().replace(":", "-").replace(".", "-")

    def mig_device_name(self, mig: MigDevice) -> str:
        return self.mig_name(mig.profile, mig.placement_start)

    def mig_name(self, profile: str, start: int) -> str:
        """parent + profile + placement start: the same for a pre-made and a dynamic instance."""
        return f"{self.device_name}-mig-{profile.replace('.', '').replace('+', '-').lower()}-{start}"

    def mig_placements(self) -> list[MigPlacement]:
        """Every (profile, placement) NVML lists, smallest profiles first."""
        profiles = sorted(
            self.mig_profiles, key=lambda p: (p.memory_slices, p.compute_slices, p.memory_bytes)
        )
        return [MigPlacement(p, start) for p in profiles for start in p.placements]

    @property
    def memory_slice_count(self) -> int:
        return max((s + p.memory_slices for p in self.mig_profiles for s in p.placements), default=0)


@dataclass
class Inventory:
    """Everything discovery found on one node."""

    node_name: str
    driver_version: str | None  # as NVML reports it, e.g. "535.161.08"
    cuda_driver_version: int | None  # NVML encoding, e.g. 12080
    gpus: list[Gpu] = field(default_factory=list)
    # PCIe distance between GPUs, keyed by (index, index): "PIX", "PXB", "PHB", "NODE" or "SYS".
    pcie_topology: dict[tuple[int, int], str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # why a GPU was left out

    def domains(self) -> dict[str, list[Gpu]]:
        """NVLink domain id -> its GPUs, in index order."""
        out: dict[str, list[Gpu]] = {}
        for gpu in sorted(self.gpus, key=lambda g: g.index):
            if gpu.nvlink_domain is not None:
                out.setdefault(gpu.nvlink_domain, []).append(gpu)
        return out

    def to_dict(self) -> dict[str, Any]:
        gpus = []
        for gpu in self.gpus:
            d = asdict(gpu)
            d["deviceName"] = gpu.device_name
            for mig, md in zip(gpu.mig_devices, d["mig_devices"], strict=True):
                md["deviceName"] = gpu.mig_device_name(mig)
            gpus.append(_camel_keys(d))
        return {
            "nodeName": self.node_name,
            "driverVersion": self.driver_version,
            "cudaDriverVersion": self.cuda_driver_version,
            "gpus": gpus,
            "domains": {k: [g.index for g in v] for k, v in self.domains().items()},
            "skipped": list(self.skipped),
        }


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


def _camel_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {_camel(k) if isinstance(k, str) else k: _camel_keys(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_camel_keys(v) for v in value]
    return value
