"""Simulated node profiles: YAML data describing a node's GPUs as NVML would report them.

A profile is loaded by name (one of the files shipped in `profiles/`) or from a path, checked
strictly, and served by the simulated driver's libnvidia-ml.so.1 built from it (`simnode`;
in in-process tests and benchmarks, by `FakeNvml`, `fake.py`). Every problem is reported with
the file, the GPU and the field it is about.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from dra_gpu.common.decoding import DecodeError, check_bounds, load_yaml, read_bounded

BUILTIN_PROFILES = (
    "hgx-2x4",
    "dgx-h100",
    "dgx-a100-mig",
    "dgx-a100-40gb-mig",
    "dgx-h100-mig",
    "mixed",
    "pcie-pairs",
)
MEMORY_SLICES = 8  # of an A100 / H100 80GB (MIG user guide)

BRANDS = {
    "unknown": 0,
    "quadro": 1,
    "tesla": 2,
    "nvs": 3,
    "grid": 4,
    "geforce": 5,
    "titan": 6,
    "nvidia-rtx": 13,
    "nvidia": 14,
    "geforce-rtx": 15,
}
ARCHITECTURES = {
    "kepler": 2,
    "maxwell": 3,
    "pascal": 4,
    "volta": 5,
    "turing": 6,
    "ampere": 7,
    "ada": 8,
    "hopper": 9,
    "blackwell": 10,
}
# Names accepted in `nvmlErrors`, mapped to the NVML return codes they raise.
NVML_ERROR_CODES = {
    "Uninitialized": 1,
    "InvalidArgument": 2,
    "NotSupported": 3,
    "NoPermission": 4,
    "NotFound": 6,
    "InsufficientSize": 7,
    "DriverNotLoaded": 9,
    "Timeout": 10,
    "LibraryNotFound": 12,
    "FunctionNotFound": 13,
    "CorruptedInforom": 14,
    "GpuIsLost": 15,
    "ResetRequired": 16,
    "OperatingSystem": 17,
    "InUse": 19,
    "InsufficientResources": 23,
    "Memory": 20,
    "NoData": 21,
    "NotReady": 27,
    "GpuNotFound": 28,
    "InvalidState": 29,
    "Unknown": 999,
}

# One-shot NVML failures for a simulated node, e.g. "nvmlGpuInstanceCreateComputeInstance=Unknown".
NODE_FAILURE_ENV = "DRA_GPU_SIM_NVML_FAIL"

_PCI_RE = re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]$")
_UUID_RE = re.compile(r"^GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
_MIG_UUID_RE = re.compile(r"^MIG-[0-9a-fA-F-]{36}$")
_MIG_NAME_RE = re.compile(r"^\d+g\.\d+gb$")


# Bounds on what a profile may describe: well above any real node (an NVL72 rack is 72 GPUs, 18
# NVLinks each), low enough that deriving NVLink domains stays fast.
MAX_PROFILE_BYTES = 512 * 1024  # a 256-GPU profile is ~100 KiB
MAX_GPUS = 256
MAX_NVSWITCHES = 64
MAX_NVLINKS = 18  # per GPU: NVLink 4 (Hopper) has 18, Blackwell 18
MAX_MIG_PROFILES = 64
MAX_MIG_INSTANCES = 7
MAX_MIG_SLICE = 7  # memory slices 0..7
MAX_MODULE_ID = 8  # GPU modules of an HGX baseboard: 1..8


class ProfileError(ValueError):
    """A profile that cannot be served; the message names file, GPU and field."""


@dataclass(frozen=True)
class MigProfileSpec:
    name: str  # "3g.40gb"
    profile_id: int  # what nvidia-smi mig -lgip calls the profile ID
    index: int  # NVML_GPU_INSTANCE_PROFILE_* enum value
    slice_count: int  # compute slices: 3 for 3g.40gb
    placement_size: int  # memory slices it occupies: 4 for 3g.40gb
    memory_mib: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg: int
    ofa: int
    placements: tuple[int, ...] = ()  # memory-slice starts NVML lists as possible
    max_instances: int = 0  # NVML's instanceCount


@dataclass(frozen=True)
class MigInstanceSpec:
    profile: str
    placement: int
    gi_id: int
    uuid: str


@dataclass(frozen=True)
class NvLinkSpec:
    remote: str  # PCI bus id of a GPU or NVSwitch
    links: int


@dataclass(frozen=True)
class FabricSpec:
    cluster_uuid: str
    clique_id: int
    state: int  # NVML_GPU_FABRIC_STATE_*


@dataclass
class GpuSpec:
    index: int
    minor: int
    uuid: str
    name: str
    brand: int
    architecture: int
    compute_capability: tuple[int, int]
    memory_mib: int
    pci_bus_id: str
    numa_node: int | None
    pcie_root: str | None
    pcie_switch: str | None
    nvlink_count: int
    nvlinks: list[NvLinkSpec] = field(default_factory=list)
    mig_capable: bool = False
    mig_enabled: bool = False
    mig_instances: list[MigInstanceSpec] = field(default_factory=list)
    fabric: FabricSpec | None = None
    nvml_errors: dict[str, int] = field(default_factory=dict)
    module_id: int = 0  # its module on the baseboard (nvmlDeviceGetModuleId); 0: not on a baseboard


@dataclass
class NodeProfile:
    name: str
    source: str  # file the profile came from, for messages
    driver_version: str
    cuda_driver_version: int
    nvswitches: list[str]
    mig_profiles: dict[str, MigProfileSpec]
    gpus: list[GpuSpec]
    nvml_errors: dict[str, int] = field(default_factory=dict)  # node-level (e.g. nvmlInit)


def load_profile(name_or_path: str) -> NodeProfile:
    """Load a built-in profile by name, or a profile file by path."""
    if name_or_path in BUILTIN_PROFILES:
        ref = resources.files("simnode").joinpath(f"profiles/{name_or_path}.yaml")
        return parse_profile(ref.read_text(encoding="utf-8"), source=f"{name_or_path}.yaml")
    path = Path(name_or_path)
    if not path.exists():
        raise ProfileError(
            f"profile {name_or_path!r}: not a built-in profile ({', '.join(BUILTIN_PROFILES)}) "
            "and no such file"
        )
    try:
        text = read_bounded(str(path), MAX_PROFILE_BYTES)
    except DecodeError as exc:
        raise ProfileError(f"{path}: cannot read profile: {exc}") from exc
    return parse_profile(text, source=str(path))


def parse_profile(text: str, source: str) -> NodeProfile:
    """Decode a profile: YAML without aliases, bounded in size and nesting, then checked field by field."""
    if len(text) > MAX_PROFILE_BYTES:
        raise ProfileError(f"{source}: larger than {MAX_PROFILE_BYTES} bytes")
    try:
        doc = load_yaml(text)
    except yaml.YAMLError as exc:
        raise ProfileError(f"{source}: not valid YAML: {exc}") from exc
    except RecursionError as exc:
        raise ProfileError(f"{source}: not valid YAML: nested too deeply") from exc
    bounds = check_bounds(doc, depth_limit=8)
    if bounds:
        where, message = bounds[0]
        raise ProfileError(f"{source}: {where}: {message}")
    return _Parser(source).node(doc)


class _Parser:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, msg: str) -> ProfileError:
        return ProfileError(f"{self.source}: {where}: {msg}")

    def get(
        self,
        d: dict[str, Any],
        key: str,
        kind: type | tuple[type, ...],
        where: str,
        default: Any = ...,
    ) -> Any:
        if key not in d:
            if default is ...:
                raise self.fail(where, f"field {key!r} is required")
            return default
        value = d[key]
        # bool is an int in Python; a YAML `true` is never a valid number here.
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            raise self.fail(where, f"field {key!r} must be {_kind_name(kind)}, not a boolean")
        if not isinstance(value, kind):
            hint = ""
            if kind is str and isinstance(value, int | float):
                hint = " (YAML reads some unquoted values as numbers: quote it)"
            raise self.fail(
                where,
                f"field {key!r} must be {_kind_name(kind)}, got {type(value).__name__}{hint}",
            )
        return value

    def at_most(self, items: list[Any], limit: int, where: str) -> None:
        if len(items) > limit:
            raise self.fail(where, f"has {len(items)} entries, at most {limit} are accepted")

    def positive(self, d: dict[str, Any], key: str, where: str, default: Any = ..., minimum: int = 1) -> int:
        """An integer field that must be >= `minimum` (sizes, counts)."""
        value: int = self.get(d, key, int, where, default)
        if value < minimum:
            raise self.fail(where, f"field {key!r} must be at least {minimum}, got {value}")
        return value

    def check_keys(self, d: dict[str, Any], allowed: set[str], where: str) -> None:
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise self.fail(where, f"unknown field {unknown[0]!r} (known: {', '.join(sorted(allowed))})")

    def errors(self, d: dict[str, Any], where: str) -> dict[str, int]:
        raw = self.get(d, "nvmlErrors", dict, where, {})
        out = {}
        for fn, err in raw.items():
            if not isinstance(fn, str) or not (fn == "*" or fn.startswith("nvml")):
                raise self.fail(where, f"nvmlErrors: key {fn!r} must be an nvml function name or '*'")
            if not isinstance(err, str) or err not in NVML_ERROR_CODES:
                raise self.fail(
                    where,
                    f"nvmlErrors.{fn}: unknown NVML error {err!r} "
                    f"(known: {', '.join(sorted(NVML_ERROR_CODES))})",
                )
            out[fn] = NVML_ERROR_CODES[err]
        return out

    def node(self, doc: Any) -> NodeProfile:
        if not isinstance(doc, dict):
            raise self.fail("top level", "a profile must be a mapping")
        self.check_keys(
            doc,
            {
                "name",
                "description",
                "driverVersion",
                "cudaDriverVersion",
                "nvswitches",
                "migProfiles",
                "defaults",
                "gpus",
                "nvmlErrors",
            },
            "top level",
        )
        name = self.get(doc, "name", str, "top level")
        driver = self.get(doc, "driverVersion", str, "top level")
        if not re.fullmatch(r"\d+(\.\d+){1,2}", driver):
            raise self.fail("driverVersion", f"{driver!r} is not a driver version like 570.133.20")
        cuda = self.positive(doc, "cudaDriverVersion", "top level")
        switches = self.get(doc, "nvswitches", list, "top level", [])
        self.at_most(switches, MAX_NVSWITCHES, "nvswitches")
        for i, sw in enumerate(switches):
            if not isinstance(sw, str) or not _PCI_RE.match(sw):
                raise self.fail(f"nvswitches[{i}]", f"{sw!r} is not a PCI bus id")
        mig_profiles = {}
        raw_mig_profiles = self.get(doc, "migProfiles", list, "top level", [])
        self.at_most(raw_mig_profiles, MAX_MIG_PROFILES, "migProfiles")
        for i, mp in enumerate(raw_mig_profiles):
            spec = self.mig_profile(mp, f"migProfiles[{i}]")
            mig_profiles[spec.name] = spec
        defaults = self.get(doc, "defaults", dict, "top level", {})
        raw_gpus = self.get(doc, "gpus", list, "top level")
        self.at_most(raw_gpus, MAX_GPUS, "gpus")
        gpus = []
        for i, raw in enumerate(raw_gpus):
            if not isinstance(raw, dict):
                raise self.fail(f"gpus[{i}]", "each GPU must be a mapping")
            gpus.append(self.gpu({**defaults, **raw}, i, mig_profiles))
        self.cross_check(gpus, switches)
        return NodeProfile(
            name=name,
            source=self.source,
            driver_version=driver,
            cuda_driver_version=cuda,
            nvswitches=switches,
            mig_profiles=mig_profiles,
            gpus=gpus,
            nvml_errors=self.errors(doc, "top level"),
        )

    def mig_profile(self, mp: Any, where: str) -> MigProfileSpec:
        if not isinstance(mp, dict):
            raise self.fail(where, "must be a mapping")
        name = self.get(mp, "name", str, where)
        if not _MIG_NAME_RE.match(name):
            raise self.fail(where, f"name {name!r} is not a MIG profile name like 3g.40gb")
        self.check_keys(
            mp,
            {
                "name",
                "id",
                "index",
                "slices",
                "placementSize",
                "placements",
                "maxInstances",
                "memoryMiB",
                "multiprocessors",
                "copyEngines",
                "decoders",
                "encoders",
                "jpeg",
                "ofa",
            },
            where,
        )
        slices = self.positive(mp, "slices", where)
        size = self.positive(mp, "placementSize", where, slices)
        if slices > MAX_MIG_SLICE + 1 or size > MAX_MIG_SLICE + 1:
            raise self.fail(where, f"a MIG profile spans at most {MAX_MIG_SLICE + 1} slices")
        # Without a list: every aligned start that fits (real GPUs list fewer, e.g. 2g.20gb).
        default = list(range(0, MEMORY_SLICES - size + 1, size))
        placements = self.get(mp, "placements", list, where, default)
        for start in placements:
            if (
                isinstance(start, bool)
                or not isinstance(start, int)
                or start % size
                or not (0 <= start <= MEMORY_SLICES - size)
            ):
                raise self.fail(
                    f"{where}: placements",
                    f"{start!r} is not a start of a {size}-slice placement within {MEMORY_SLICES} slices",
                )
        return MigProfileSpec(
            name=name,
            profile_id=self.positive(mp, "id", where, minimum=0),
            index=self.positive(mp, "index", where, minimum=0),
            slice_count=slices,
            placement_size=size,
            memory_mib=self.positive(mp, "memoryMiB", where),
            multiprocessors=self.positive(mp, "multiprocessors", where),
            copy_engines=self.positive(mp, "copyEngines", where, 0, minimum=0),
            decoders=self.positive(mp, "decoders", where, 0, minimum=0),
            encoders=self.positive(mp, "encoders", where, 0, minimum=0),
            jpeg=self.positive(mp, "jpeg", where, 0, minimum=0),
            ofa=self.positive(mp, "ofa", where, 0, minimum=0),
            placements=tuple(placements),
            max_instances=self.positive(mp, "maxInstances", where, len(placements), minimum=0),
        )

    def gpu(self, g: dict[str, Any], i: int, mig_profiles: dict[str, MigProfileSpec]) -> GpuSpec:
        idx = g.get("index", i)
        where = f"GPU {idx}" if isinstance(idx, int) else f"gpus[{i}]"
        self.check_keys(
            g,
            {
                "index",
                "minor",
                "uuid",
                "name",
                "brand",
                "architecture",
                "computeCapability",
                "memoryMiB",
                "pciBusId",
                "numaNode",
                "pcieRoot",
                "pcieSwitch",
                "nvlinkCount",
                "nvlinks",
                "mig",
                "fabric",
                "nvmlErrors",
                "moduleId",
            },
            where,
        )
        index = self.positive(g, "index", where, minimum=0)
        uuid = self.get(g, "uuid", str, where)
        if not _UUID_RE.match(uuid):
            raise self.fail(f"{where}: uuid", f"{uuid!r} is not a GPU UUID (GPU-xxxxxxxx-xxxx-...)")
        brand = self.get(g, "brand", str, where)
        if brand not in BRANDS:
            raise self.fail(f"{where}: brand", f"unknown brand {brand!r} (known: {', '.join(BRANDS)})")
        arch = self.get(g, "architecture", str, where)
        if arch not in ARCHITECTURES:
            raise self.fail(
                f"{where}: architecture", f"unknown architecture {arch!r} (known: {', '.join(ARCHITECTURES)})"
            )
        cc = str(self.get(g, "computeCapability", (str, float), where))
        m = re.fullmatch(r"(\d+)\.(\d+)", cc)
        if not m:
            raise self.fail(f"{where}: computeCapability", f"{cc!r} is not like '9.0'")
        pci = self.get(g, "pciBusId", str, where)
        if not _PCI_RE.match(pci):
            raise self.fail(f"{where}: pciBusId", f"{pci!r} is not a PCI bus id like 00000000:18:00.0")
        memory = self.get(g, "memoryMiB", int, where)
        if memory <= 0:
            raise self.fail(f"{where}: memoryMiB", f"must be positive, got {memory}")
        nvlink_count = self.positive(g, "nvlinkCount", where, 0, minimum=0)
        if nvlink_count > MAX_NVLINKS:
            raise self.fail(f"{where}: nvlinkCount", f"at most {MAX_NVLINKS}, got {nvlink_count}")
        nvlinks = []
        used = 0
        raw_links = self.get(g, "nvlinks", list, where, [])
        self.at_most(raw_links, MAX_NVLINKS, f"{where}: nvlinks")
        for j, link in enumerate(raw_links):
            lw = f"{where}: nvlinks[{j}]"
            if not isinstance(link, dict):
                raise self.fail(lw, "must be a mapping with remote and links")
            remote = self.get(link, "remote", str, lw)
            if not _PCI_RE.match(remote):
                raise self.fail(lw, f"remote {remote!r} is not a PCI bus id")
            if remote.lower() == pci.lower():
                raise self.fail(lw, f"remote {remote} is this GPU itself: a GPU has no NVLink to itself")
            count = self.get(link, "links", int, lw)
            if count <= 0:
                raise self.fail(lw, f"links must be positive, got {count}")
            used += count
            nvlinks.append(NvLinkSpec(remote=remote, links=count))
        if used > nvlink_count:
            raise self.fail(f"{where}: nvlinks", f"uses {used} links but nvlinkCount is {nvlink_count}")
        mig = self.get(g, "mig", dict, where, None)
        mig_enabled, instances = False, []
        if mig is not None:
            if ARCHITECTURES[arch] < ARCHITECTURES["ampere"]:
                raise self.fail(f"{where}: mig", f"a {arch} GPU has no MIG (Ampere or newer has)")
            self.check_keys(mig, {"enabled", "instances"}, f"{where}: mig")
            mig_enabled = self.get(mig, "enabled", bool, f"{where}: mig")
            raw_instances = self.get(mig, "instances", list, f"{where}: mig", [])
            self.at_most(raw_instances, MAX_MIG_INSTANCES, f"{where}: mig.instances")
            for j, inst in enumerate(raw_instances):
                instances.append(
                    self.mig_instance(inst, f"{where}: mig.instances[{j}]", mig_profiles, uuid, j)
                )
            if instances and not mig_enabled:
                raise self.fail(f"{where}: mig", "instances are listed but MIG is not enabled")
            self.check_placements(instances, mig_profiles, f"{where}: mig.instances")
        fabric = None
        if "fabric" in g:
            f = self.get(g, "fabric", dict, where)
            fw = f"{where}: fabric"
            fabric = FabricSpec(
                cluster_uuid=self.get(f, "clusterUuid", str, fw),
                clique_id=self.positive(f, "cliqueId", fw, minimum=0),
                state=self.positive(f, "state", fw, 3, minimum=0),
            )
            if not re.fullmatch(r"[0-9a-fA-F-]{32,36}", fabric.cluster_uuid):
                raise self.fail(fw, f"clusterUuid {fabric.cluster_uuid!r} is not a UUID")
        numa = self.get(g, "numaNode", int, where, None)
        if numa is not None and numa < 0:
            raise self.fail(f"{where}: numaNode", f"must be 0 or more, got {numa}")
        return GpuSpec(
            index=index,
            minor=self.positive(g, "minor", where, index, minimum=0),
            uuid=uuid,
            name=self.get(g, "name", str, where),
            brand=BRANDS[brand],
            architecture=ARCHITECTURES[arch],
            compute_capability=(int(m.group(1)), int(m.group(2))),
            memory_mib=memory,
            pci_bus_id=pci,
            numa_node=numa,
            pcie_root=self.get(g, "pcieRoot", str, where, None),
            pcie_switch=self.get(g, "pcieSwitch", str, where, None),
            nvlink_count=nvlink_count,
            nvlinks=nvlinks,
            mig_capable=mig is not None,
            mig_enabled=mig_enabled,
            mig_instances=instances,
            fabric=fabric,
            nvml_errors=self.errors(g, where),
            module_id=self.module_id(g, where),
        )

    def module_id(self, g: dict[str, Any], where: str) -> int:
        """The GPU's module on its baseboard (0: a PCIe card, not a baseboard product)."""
        value = self.positive(g, "moduleId", where, 0, minimum=0)
        if value > MAX_MODULE_ID:
            raise self.fail(
                f"{where}: moduleId", f"an HGX baseboard has modules 1..{MAX_MODULE_ID}, got {value}"
            )
        return value

    def mig_instance(
        self, inst: Any, where: str, mig_profiles: dict[str, MigProfileSpec], parent_uuid: str, position: int
    ) -> MigInstanceSpec:
        if not isinstance(inst, dict):
            raise self.fail(where, "must be a mapping with profile and placement")
        profile = self.get(inst, "profile", str, where)
        if profile not in mig_profiles:
            known = ", ".join(mig_profiles) or "none: add migProfiles"
            raise self.fail(f"{where}: profile", f"unknown MIG profile {profile!r} (known: {known})")
        placement = self.positive(inst, "placement", where, minimum=0)
        default_uuid = "MIG-" + parent_uuid[4:12] + f"-{position:04d}" + parent_uuid[17:]
        uuid = self.get(inst, "uuid", str, where, default_uuid)
        if not _MIG_UUID_RE.match(uuid):
            raise self.fail(f"{where}: uuid", f"{uuid!r} is not a MIG UUID")
        return MigInstanceSpec(
            profile=profile,
            placement=placement,
            gi_id=self.positive(inst, "gpuInstanceId", where, position + 1),
            uuid=uuid,
        )

    def check_placements(
        self, instances: list[MigInstanceSpec], mig_profiles: dict[str, MigProfileSpec], where: str
    ) -> None:
        taken: dict[int, str] = {}
        for inst in instances:
            spec = mig_profiles[inst.profile]
            if inst.placement not in spec.placements:
                starts = ", ".join(map(str, spec.placements))
                raise self.fail(
                    where, f"{inst.profile} cannot start at slice {inst.placement} (possible: {starts})"
                )
            for s in range(inst.placement, inst.placement + spec.placement_size):
                if s > 7:
                    raise self.fail(where, f"{inst.profile} at {inst.placement} runs past slice 7")
                if s in taken:
                    raise self.fail(
                        where, f"{inst.profile} at {inst.placement} overlaps {taken[s]} on memory slice {s}"
                    )
                taken[s] = f"{inst.profile} at {inst.placement}"

    def cross_check(self, gpus: list[GpuSpec], switches: list[str]) -> None:
        seen: dict[str, int] = {}
        for key in ("index", "minor", "uuid", "pci_bus_id"):
            seen = {}
            for gpu in gpus:
                value = str(getattr(gpu, key)).lower()
                if value in seen:
                    raise self.fail(
                        f"GPU {gpu.index}: {_camel(key)}", f"duplicate {value!r} (also GPU {seen[value]})"
                    )
                seen[value] = gpu.index
        known = {g.pci_bus_id.lower() for g in gpus} | {s.lower() for s in switches}
        for gpu in gpus:
            for j, link in enumerate(gpu.nvlinks):
                if link.remote.lower() not in known:
                    raise self.fail(
                        f"GPU {gpu.index}: nvlinks[{j}].remote",
                        f"{link.remote} is neither a GPU of this node nor an nvswitch",
                    )


def _camel(name: str) -> str:
    return {"pci_bus_id": "pciBusId"}.get(name, name)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {
        int: "an integer",
        str: "a string",
        float: "a number",
        bool: "a boolean",
        list: "a list",
        dict: "a mapping",
    }
    return " or ".join(names.get(k, k.__name__) for k in kinds)
