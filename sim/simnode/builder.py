"""Build a simulated NVIDIA driver root: the user-space files a driver installation puts on a host.

The root has the Debian layout of a driver installed on the host (driver root `/`):

    usr/lib/<multiarch>/<lib>.so.<V>     real ELF shared objects with the real SONAMEs, plus the
                                         SONAME links and libcuda.so / libnvidia-ml.so
    usr/bin/nvidia-smi, ...              real ELF programs; nvidia-smi needs libnvidia-ml.so.1
    lib/firmware/nvidia/<V>/gsp_*.bin    GSP firmware stand-ins

libnvidia-ml.so.1 is compiled against NVIDIA's nvml.h (see nvml_header) and serves the node a
profile describes (GPUs, NVLinks, MIG profiles and instances, fabric), exporting the functions
the real library of version V exports (exports.py). libcuda and libnvidia-ml carry the node's
GPU table (compiled in from a generated header, as the kernel module knows its GPUs) and report
a GPU only where its /dev/nvidia<minor> character device (major 195) exists, so a container sees
exactly the device nodes it was given. DRA_GPU_SIM_DEV_DIR (default /dev) moves that lookup and
the node's kernel-side state files (.nvidia-sim/); it exists for simulated nodes and tests.

Python stdlib and a C compiler only (plus the profile loader, profiles.py). Every root
is built in a temporary directory and renamed into place.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import uuid as uuidlib
from dataclasses import dataclass
from pathlib import Path

from simnode import exports
from simnode.nvml_header import NvmlHeaderError, header_digest, nvml_header
from simnode.profiles import NVML_ERROR_CODES, GpuSpec, MigProfileSpec, NodeProfile, load_profile

SRC = Path(__file__).resolve().parent / "src"
CFLAGS = ["-O1", "-fPIC", "-s", "-Wall", "-std=gnu11"]
DEFAULT_CUDA_VERSION = 12080
FIRMWARE = ("gsp_ga10x.bin", "gsp_tu10x.bin")
TOOLS = ("nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-server")
# Programs with behaviour of their own: file name -> source.
PROGRAMS = {"nvidia-cuda-mps-control": "mps-control.c"}
_VERSION_RE = re.compile(r"^\d+\.\d+(\.\d+)?$")
_PCI_RE = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
HOPPER = 9
CACHE_ENV = "DRA_GPU_CACHE_DIR"


def cc() -> str:
    return os.environ.get("CC", "cc")


@dataclass(frozen=True)
class SimGpu:
    """One GPU as the simulated kernel module knows it (a plain H100-like GPU, no MIG, no NVLink)."""

    minor: int
    uuid: str
    name: str
    pci_bus_id: str  # "0000:18:00.0" or NVML's "00000000:18:00.0"
    memory_mib: int


@dataclass(frozen=True)
class Library:
    """A driver library: file `<stem>.<version>`, its SONAME (None: the versioned file name)."""

    stem: str
    soname: str | None
    source: str = "stub.c"


LIBRARIES = (
    Library("libcuda.so", "libcuda.so.1", "libcuda.c"),
    Library("libnvidia-ml.so", "libnvidia-ml.so.1", "libnvidia-ml.c"),
    Library("libnvidia-ptxjitcompiler.so", "libnvidia-ptxjitcompiler.so.1"),
    Library("libnvidia-nvvm.so", "libnvidia-nvvm.so.4"),
    Library("libcudadebugger.so", "libcudadebugger.so.1"),
    Library("libnvidia-opencl.so", "libnvidia-opencl.so.1"),
    Library("libnvidia-gpucomp.so", None),
    Library("libnvidia-allocator.so", "libnvidia-allocator.so.1"),
    Library("libnvidia-cfg.so", "libnvidia-cfg.so.1"),
)
# Development links the driver installer makes (what `-lcuda` / `-lnvidia-ml` resolve).
DEV_LINKS = {"libcuda.so": "libcuda.so.1", "libnvidia-ml.so": "libnvidia-ml.so.1"}
# The libraries an older driver leaves behind in the stale-version case.
STALE_LIBRARIES = ("libcuda.so", "libnvidia-ml.so")


class SimDriverError(RuntimeError):
    """The driver root could not be built; the message says which input or command failed."""


def default_cache_dir() -> Path:
    """$DRA_GPU_CACHE_DIR, else $XDG_CACHE_HOME/dra-gpu, else ~/.cache/dra-gpu."""
    named = os.environ.get(CACHE_ENV)
    if named:
        return Path(named)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dra-gpu"


@functools.cache
def multiarch() -> str:
    """The machine's Debian multiarch triplet (library directory name), e.g. x86_64-linux-gnu."""
    _need_cc()
    out = subprocess.run([cc(), "-print-multiarch"], check=True, capture_output=True, text=True)
    triplet = out.stdout.strip()
    if not triplet:
        raise SimDriverError(f"{cc()} -print-multiarch printed nothing; a Debian gcc is needed")
    return triplet


def lib_dir(root: Path) -> Path:
    """Where the driver libraries are inside a driver root."""
    return Path(root) / "usr" / "lib" / multiarch()


def _need_cc() -> None:
    if shutil.which(cc()) is None:
        raise SimDriverError(
            f"no C compiler {cc()!r}: a simulated node's driver is compiled on first use "
            "(install gcc and libc6-dev, or set CC)"
        )


def _c_string(value: str, what: str) -> str:
    if not all(0x20 <= ord(c) < 0x7F for c in value):
        raise SimDriverError(f"{what} {value!r}: only printable ASCII can go into the GPU table")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _check_version(version: str, what: str) -> None:
    if not _VERSION_RE.match(version):
        raise SimDriverError(f"{what} {version!r} is not a driver version like 570.133.20")


def profile_of_gpus(gpus: list[SimGpu], version: str, cuda_version: int) -> NodeProfile:
    """A node of plain GPUs (the SimGpu form): NVIDIA brand, Hopper, no MIG, no NVLink."""
    specs = [
        GpuSpec(
            index=i,
            minor=g.minor,
            uuid=g.uuid,
            name=g.name,
            brand=14,
            architecture=HOPPER,
            compute_capability=(9, 0),
            memory_mib=g.memory_mib,
            pci_bus_id=g.pci_bus_id,
            numa_node=None,
            pcie_root=None,
            pcie_switch=None,
            nvlink_count=0,
        )
        for i, g in enumerate(sorted(gpus, key=lambda g: g.minor))
    ]
    return NodeProfile("simgpus", "SimGpu list", version, cuda_version, [], {}, specs)


def _pci(bus_id: str, what: str) -> tuple[int, int, int, int]:
    m = _PCI_RE.match(bus_id)
    if not m:
        raise SimDriverError(f"{what}: pci_bus_id {bus_id!r} is not like 0000:18:00.0")
    dom, bus, dev, fn = (int(x, 16) for x in m.groups())
    return dom, bus, dev, fn


def _mig_profile_row(p: MigProfileSpec) -> str:
    placements = ", ".join(str(s) for s in p.placements) or "0"
    return (
        f"    {{.name = {_c_string(p.name, 'MIG profile')}, .id = {p.profile_id}, .index = {p.index}, "
        f".slices = {p.slice_count}, .size = {p.placement_size}, .memory_mib = {p.memory_mib}ULL, "
        f".sms = {p.multiprocessors}, .copy_engines = {p.copy_engines}, .decoders = {p.decoders}, "
        f".encoders = {p.encoders}, .jpeg = {p.jpeg}, .ofa = {p.ofa}, .max_instances = {p.max_instances}, "
        f".nplacements = {len(p.placements)}, .placements = {{{placements}}}}},"
    )


def gpu_table_header(version: str, cuda_version: int, profile: NodeProfile) -> str:
    """The generated C header: versions, the GPU table in minor order, MIG profiles, links."""
    _check_version(version, "version")
    gpus = sorted(profile.gpus, key=lambda g: g.minor)
    minors = [g.minor for g in gpus]
    if len(set(minors)) != len(minors) or any(not 0 <= m < 255 for m in minors):
        raise SimDriverError(f"GPU minors {minors} must be unique and in 0..254 (255 is nvidiactl)")
    mig_names = list(profile.mig_profiles)
    gpu_buses = {g.pci_bus_id.lower() for g in gpus}
    roots = {r: i for i, r in enumerate(sorted({g.pcie_root for g in gpus if g.pcie_root}))}
    switches = {s: i for i, s in enumerate(sorted({g.pcie_switch for g in gpus if g.pcie_switch}))}
    pre: list[str] = []
    rows: list[str] = []
    for g in gpus:
        dom, bus, dev, fn = _pci(g.pci_bus_id, f"GPU minor {g.minor}")
        links = []
        for nv in g.nvlinks:
            remote = _c_string(nv.remote, f"GPU {g.uuid} nvlink")
            links += [f"{{{remote}, {int(nv.remote.lower() in gpu_buses)}}}"] * nv.links
        links += ["{0, 0}"] * (g.nvlink_count - len(links))
        pre.append(
            f"static const struct sim_link SIM_LINKS_{g.minor}[] = {{{', '.join(links) or '{0, 0}'}}};"
        )
        made = [
            f"{{{mig_names.index(i.profile)}, {i.placement}, {i.gi_id}, {_c_string(i.uuid, 'MIG uuid')}}}"
            for i in g.mig_instances
        ]
        pre.append(
            f"static const struct sim_premade SIM_PREMADE_{g.minor}[] = {{{', '.join(made) or '{0}'}}};"
        )
        fabric = ".has_fabric = 0"
        if g.fabric is not None:
            raw = ", ".join(str(b) for b in uuidlib.UUID(g.fabric.cluster_uuid).bytes)
            fabric = (
                f".has_fabric = 1, .cluster_uuid = {{{raw}}}, .clique_id = {g.fabric.clique_id}, "
                f".fabric_state = {g.fabric.state}"
            )
        device_id = 0x233010DE if g.architecture == HOPPER else 0x20B510DE
        rows.append(
            f"    {{.minor = {g.minor}, .uuid = {_c_string(g.uuid, f'GPU minor {g.minor} uuid')}, "
            f".name = {_c_string(g.name, f'GPU {g.uuid} name')}, .domain = {dom}, .bus = {bus}, "
            f".device = {dev}, .function = {fn}, .memory_mib = {g.memory_mib}ULL, .brand = {g.brand}, "
            f".arch = {g.architecture}, .cc_major = {g.compute_capability[0]}, "
            f".cc_minor = {g.compute_capability[1]}, .pci_device_id = {device_id:#x}u, "
            f".numa = {-1 if g.numa_node is None else g.numa_node}, "
            f".pcie_root = {roots.get(g.pcie_root or '', -1)}, "
            f".pcie_switch = {switches.get(g.pcie_switch or '', -1)}, .nvlink_count = {g.nvlink_count}, "
            f".links = SIM_LINKS_{g.minor}, .mig_capable = {int(g.mig_capable)}, "
            f".mig_enabled = {int(g.mig_enabled)}, .npremade = {len(g.mig_instances)}, "
            f".premade = SIM_PREMADE_{g.minor}, .module_id = {g.module_id}, {fabric}}},"
        )
    mig_rows = [_mig_profile_row(p) for p in profile.mig_profiles.values()]
    # The profile's injected NVML errors (nvmlErrors): per GPU (index into SIM_GPUS) and node-wide.
    errors = [(-1, fn, code) for fn, code in sorted(profile.nvml_errors.items())]
    for i, g in enumerate(gpus):
        errors += [(i, fn, code) for fn, code in sorted(g.nvml_errors.items())]
    error_rows = [f"    {{{gpu}, {_c_string(fn, 'nvmlErrors key')}, {code}}}," for gpu, fn, code in errors]
    name_rows = [f"    {{{_c_string(n, 'error name')}, {c}}}," for n, c in sorted(NVML_ERROR_CODES.items())]
    return "\n".join(
        [
            "/* Generated by sim/simnode/builder.py: the GPUs this simulated driver knows. */",
            f"#define SIM_DRIVER_VERSION {_c_string(version, 'version')}",
            f"#define SIM_DRIVER_MAJOR {exports.driver_major(version)}",
            f"#define SIM_CUDA_VERSION {int(cuda_version)}",
            f"#define SIM_MIG_COMPUTE_MODE_FROM {exports.MIG_COMPUTE_MODE_FROM}",
            f"#define SIM_NGPUS {len(rows)}",
            f"#define SIM_NMIG_PROFILES {len(mig_rows)}",
            "static const struct sim_mig_profile SIM_MIG_PROFILES[SIM_NMIG_PROFILES + 1] = {",
            *mig_rows,
            "};",
            *pre,
            "static const struct sim_gpu SIM_GPUS[SIM_NGPUS + 1] = {",
            *rows,
            "};",
            f"#define SIM_NERRORS {len(error_rows)}",
            "static const struct sim_error SIM_ERRORS[SIM_NERRORS + 1] = {",
            *error_rows,
            "};",
            f"#define SIM_NERROR_NAMES {len(name_rows)}",
            "static const struct sim_error_name SIM_ERROR_NAMES[] = {",
            *name_rows,
            "};",
            "",
        ]
    )


def _cc(args: list[str]) -> None:
    proc = subprocess.run([cc(), *CFLAGS, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SimDriverError(f"{cc()} {' '.join(args)} failed:\n{proc.stderr}")


def _compile_libraries(
    libdir: Path, gen: Path, header: Path, version: str, names: tuple[str, ...] | None
) -> None:
    inc = [f"-I{gen}", f"-I{SRC}", f"-I{header.parent}"]
    for lib in LIBRARIES:
        if names is not None and lib.stem not in names:
            continue
        filename = f"{lib.stem}.{version}"
        soname = lib.soname or filename
        extra: list[str] = []
        if lib.source == "stub.c":  # one distinct exported symbol per stub library
            symbol = re.sub(r"\W", "_", lib.stem.removesuffix(".so")) + "_sim_version"
            extra = [f"-DSIM_SYMBOL={symbol}", f'-DSIM_DRIVER_VERSION="{version}"']
        if lib.stem == "libnvidia-ml.so":  # exactly what the real library of `version` exports
            script = gen / f"nvml-{version}.map"
            script.write_text(exports.version_script(version))
            extra = [f"-Wl,--version-script={script}", "-Wl,--no-undefined", "-pthread"]
        _cc(
            [
                "-shared",
                f"-Wl,-soname,{soname}",
                *inc,
                *extra,
                "-o",
                str(libdir / filename),
                str(SRC / lib.source),
            ]
        )


def _symlink(target: str, link: Path) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


def _populate(
    root: Path, version: str, cuda_version: int, profile: NodeProfile, stale: str | None, header: Path
) -> None:
    libdir = lib_dir(root)
    bindir = root / "usr" / "bin"
    fwdir = root / "lib" / "firmware" / "nvidia" / version
    for d in (libdir, bindir, fwdir):
        d.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="simdriver-gen-") as tmp:
        gen = Path(tmp)
        if stale is not None:  # the old driver's files first; the current install then links over them
            (gen / "gputable.h").write_text(gpu_table_header(stale, cuda_version, profile))
            _compile_libraries(libdir, gen, header, stale, STALE_LIBRARIES)
        (gen / "gputable.h").write_text(gpu_table_header(version, cuda_version, profile))
        _compile_libraries(libdir, gen, header, version, None)
        for lib in LIBRARIES:
            if lib.soname is not None:
                _symlink(f"{lib.stem}.{version}", libdir / lib.soname)
        for dev, soname in DEV_LINKS.items():
            _symlink(soname, libdir / dev)
        # nvidia-smi links against libnvidia-ml.so.1 (DT_NEEDED) and has no rpath.
        _cc(["-o", str(bindir / "nvidia-smi"), str(SRC / "nvidia-smi.c"), f"-L{libdir}", "-lnvidia-ml"])
        for tool in TOOLS:
            defs = [f'-DSIM_TOOL="{tool}"', f'-DSIM_DRIVER_VERSION="{version}"']
            _cc([*defs, "-o", str(bindir / tool), str(SRC / "tool.c")])
        for program, source in PROGRAMS.items():
            _cc(["-o", str(bindir / program), str(SRC / source)])
    if stale is not None:
        _symlink(f"libcuda.so.{stale}", libdir / "libcuda.so")
    for fw in FIRMWARE:
        (fwdir / fw).write_bytes(f"simulated GSP firmware {fw} for driver {version}\n".encode())


def _as_profile(gpus: list[SimGpu] | NodeProfile, version: str, cuda_version: int) -> NodeProfile:
    return gpus if isinstance(gpus, NodeProfile) else profile_of_gpus(list(gpus), version, cuda_version)


def _header(cache_dir: Path | None) -> Path:
    try:
        return nvml_header(cache_dir if cache_dir is not None else default_cache_dir())
    except NvmlHeaderError as exc:
        raise SimDriverError(str(exc)) from exc


def build_driver_root(
    dest: Path,
    version: str,
    gpus: list[SimGpu] | NodeProfile,
    *,
    stale_version: str | None = None,
    cuda_version: int = DEFAULT_CUDA_VERSION,
    cache_dir: Path | None = None,
) -> Path:
    """Build the driver root at `dest` (replacing one that is there) and return `dest`.
    `cache_dir` keeps the downloaded NVML header (default: default_cache_dir())."""
    profile = _as_profile(gpus, version, cuda_version)
    _build(Path(dest), version, profile, stale_version, cuda_version, _header(cache_dir), replace=True)
    return Path(dest)


def _build(
    dest: Path,
    version: str,
    profile: NodeProfile,
    stale: str | None,
    cuda_version: int,
    header: Path,
    *,
    replace: bool,
) -> None:
    _check_version(version, "version")
    if stale is not None:
        _check_version(stale, "stale_version")
        if stale == version:
            raise SimDriverError(f"stale_version {stale} must differ from version {version}")
    _need_cc()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        _populate(tmp, version, cuda_version, profile, stale, header)
        tmp.chmod(0o755)
        old = None
        if replace and dest.exists():  # a directory cannot be renamed over a non-empty one
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            dest.rename(old / "root")
        try:
            tmp.rename(dest)
        except OSError:
            # Only a cached root may lose the race: another process renamed the same one in first.
            if replace or not dest.is_dir():
                raise
        if old is not None:
            shutil.rmtree(old)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def profile_versions(profile: NodeProfile) -> tuple[str, int]:
    """The driver and CUDA versions a profile reports."""
    return profile.driver_version, profile.cuda_driver_version or DEFAULT_CUDA_VERSION


def cache_key(
    version: str, cuda_version: int, profile: NodeProfile, stale_version: str | None, header: Path
) -> str:
    """A hash of everything a root is made from: C sources, builder, export table, NVML header,
    GPU table, versions."""
    h = hashlib.sha256()
    for path in sorted(SRC.iterdir()):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(Path(__file__).read_bytes())
    h.update(Path(exports.__file__).read_bytes())
    h.update(header_digest(header).encode())
    h.update(gpu_table_header(version, cuda_version, profile).encode())
    if stale_version is not None:
        h.update(gpu_table_header(stale_version, cuda_version, profile).encode())
    h.update(f"stale={stale_version} arch={multiarch()} cc={cc()}".encode())
    return h.hexdigest()[:16]


def ensure_driver_root(
    cache_dir: Path,
    profile: str | Path | NodeProfile,
    version: str | None = None,
    stale_version: str | None = None,
) -> Path:
    """`<cache_dir>/simdriver/<key>` for the profile (a built-in name, a file or a NodeProfile),
    built once; a root that exists is complete. `version` overrides the profile's driverVersion."""
    node = profile if isinstance(profile, NodeProfile) else load_profile(str(profile))
    profile_version, cuda_version = profile_versions(node)
    version = version or profile_version
    _check_version(version, "version")
    header = _header(Path(cache_dir))
    dest = Path(cache_dir) / "simdriver" / cache_key(version, cuda_version, node, stale_version, header)
    if not dest.is_dir():  # never replaced: someone may be using it
        _build(dest, version, node, stale_version, cuda_version, header, replace=False)
    return dest


def nvml_library(root: Path) -> Path:
    """The libnvidia-ml.so.1 of a driver root (what a process loads by full path)."""
    return lib_dir(root) / "libnvidia-ml.so.1"


def ensure_nvml_library(
    cache_dir: Path, profile: str | Path | NodeProfile, version: str | None = None
) -> Path:
    """Only the simulated libnvidia-ml.so.1 of a profile (what a process loads by full path),
    built once under `<cache_dir>/simnvml/<key>/` (file libnvidia-ml.so.<V>, link .so.1)."""
    node = profile if isinstance(profile, NodeProfile) else load_profile(str(profile))
    profile_version, cuda_version = profile_versions(node)
    version = version or profile_version
    _check_version(version, "version")
    _need_cc()
    header = _header(Path(cache_dir))
    dest = Path(cache_dir) / "simnvml" / cache_key(version, cuda_version, node, None, header)
    if not dest.is_dir():
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
        try:
            (tmp / "gputable.h").write_text(gpu_table_header(version, cuda_version, node))
            _compile_libraries(tmp, tmp, header, version, ("libnvidia-ml.so",))
            (tmp / "gputable.h").unlink()
            (tmp / f"nvml-{version}.map").unlink()
            _symlink(f"libnvidia-ml.so.{version}", tmp / "libnvidia-ml.so.1")
            tmp.chmod(0o755)
            try:
                tmp.rename(dest)
            except OSError:
                if not dest.is_dir():  # lost the race to another builder: keep theirs
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest / "libnvidia-ml.so.1"
