#!/usr/bin/env python3
"""Build a simulated NVIDIA driver root: the user-space files a driver installation puts on a host.

    python3 e2e/simdriver/build.py --profile NAME|PATH (--out DIR | --cache DIR)
                                   [--version V] [--stale-version V] [--cuda-version N]

The root has the Debian layout of a driver installed on the host (driver root `/`):

    usr/lib/<multiarch>/<lib>.so.<V>     real ELF shared objects with the real SONAMEs, plus the
                                         SONAME links and libcuda.so / libnvidia-ml.so
    usr/bin/nvidia-smi, ...              real ELF programs; nvidia-smi needs libnvidia-ml.so.1
    lib/firmware/nvidia/<V>/gsp_*.bin    GSP firmware stand-ins

libcuda and libnvidia-ml carry the node's GPU table (compiled in from a generated header, as the
kernel module knows its GPUs) and report a GPU only where its /dev/nvidia<minor> character device
(major 195) exists, so a container sees exactly the device nodes it was given. The environment
variable DRA_GPU_SIM_DEV_DIR (default /dev) moves that lookup; it exists for unit tests only.

With --stale-version the libcuda/libnvidia-ml files of an older driver are left behind as after
an upgrade, and the unversioned libcuda.so points at the old one: a trap for code that follows it.

Python stdlib and gcc only; the CLI imports dra_gpu (run it with the project's .venv python) to
turn a profile into GPUs. Every root is built in a temporary directory and renamed into place.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parent / "src"
CC = os.environ.get("CC", "gcc")
CFLAGS = ["-O1", "-fPIC", "-s", "-Wall", "-std=gnu11"]
DEFAULT_CUDA_VERSION = 12080
FIRMWARE = ("gsp_ga10x.bin", "gsp_tu10x.bin")
TOOLS = ("nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-server")
# Programs with behaviour of their own: file name -> source.
PROGRAMS = {"nvidia-cuda-mps-control": "mps-control.c"}
_VERSION_RE = re.compile(r"^\d+\.\d+(\.\d+)?$")
_PCI_RE = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


@dataclass(frozen=True)
class SimGpu:
    """One GPU as the simulated kernel module knows it."""

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


@functools.cache
def multiarch() -> str:
    """The machine's Debian multiarch triplet (library directory name), e.g. x86_64-linux-gnu."""
    out = subprocess.run([CC, "-print-multiarch"], check=True, capture_output=True, text=True)
    triplet = out.stdout.strip()
    if not triplet:
        raise SimDriverError(f"{CC} -print-multiarch printed nothing; a Debian gcc is needed")
    return triplet


def lib_dir(root: Path) -> Path:
    """Where the driver libraries are inside a driver root."""
    return root / "usr" / "lib" / multiarch()


def _c_string(value: str, what: str) -> str:
    if not all(0x20 <= ord(c) < 0x7F for c in value):
        raise SimDriverError(f"{what} {value!r}: only printable ASCII can go into the GPU table")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _check_version(version: str, what: str) -> None:
    if not _VERSION_RE.match(version):
        raise SimDriverError(f"{what} {version!r} is not a driver version like 570.133.20")


def gpu_table_header(version: str, cuda_version: int, gpus: list[SimGpu]) -> str:
    """The generated C header: driver/CUDA versions and the GPU table in minor order."""
    _check_version(version, "version")
    minors = [g.minor for g in gpus]
    if len(set(minors)) != len(minors) or any(not 0 <= m < 255 for m in minors):
        raise SimDriverError(f"GPU minors {minors} must be unique and in 0..254 (255 is nvidiactl)")
    rows = []
    for g in sorted(gpus, key=lambda g: g.minor):
        m = _PCI_RE.match(g.pci_bus_id)
        if not m:
            raise SimDriverError(f"GPU minor {g.minor}: pci_bus_id {g.pci_bus_id!r} is not like 0000:18:00.0")
        domain, bus, dev, fn = (int(x, 16) for x in m.groups())
        uuid, name = _c_string(g.uuid, f"GPU minor {g.minor} uuid"), _c_string(g.name, f"GPU {g.uuid} name")
        rows.append(f"    {{{g.minor}, {uuid}, {name}, {domain}, {bus}, {dev}, {fn}, {g.memory_mib}ULL}},")
    return "\n".join(
        [
            "/* Generated by e2e/simdriver/build.py: the GPUs this simulated driver knows. */",
            f"#define SIM_DRIVER_VERSION {_c_string(version, 'version')}",
            f"#define SIM_CUDA_VERSION {int(cuda_version)}",
            "struct sim_gpu {",
            "    unsigned minor;",
            "    const char *uuid, *name;",
            "    unsigned domain, bus, device, function;",
            "    unsigned long long memory_mib;",
            "};",
            f"#define SIM_NGPUS {len(rows)}",
            "static const struct sim_gpu SIM_GPUS[SIM_NGPUS + 1] = {",
            *rows,
            "};",
            "",
        ]
    )


def _cc(args: list[str]) -> None:
    proc = subprocess.run([CC, *CFLAGS, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SimDriverError(f"{CC} {' '.join(args)} failed:\n{proc.stderr}")


def _compile_libraries(libdir: Path, gen: Path, version: str, names: tuple[str, ...] | None) -> None:
    inc = [f"-I{gen}", f"-I{SRC}"]
    for lib in LIBRARIES:
        if names is not None and lib.stem not in names:
            continue
        filename = f"{lib.stem}.{version}"
        soname = lib.soname or filename
        marker = []
        if lib.source == "stub.c":  # one distinct exported symbol per stub library
            symbol = re.sub(r"\W", "_", lib.stem.removesuffix(".so")) + "_sim_version"
            marker = [f"-DSIM_SYMBOL={symbol}", f'-DSIM_DRIVER_VERSION="{version}"']
        _cc(
            [
                "-shared",
                f"-Wl,-soname,{soname}",
                *inc,
                *marker,
                "-o",
                str(libdir / filename),
                str(SRC / lib.source),
            ]
        )


def _symlink(target: str, link: Path) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


def _populate(root: Path, version: str, cuda_version: int, gpus: list[SimGpu], stale: str | None) -> None:
    libdir = lib_dir(root)
    bindir = root / "usr" / "bin"
    fwdir = root / "lib" / "firmware" / "nvidia" / version
    for d in (libdir, bindir, fwdir):
        d.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="simdriver-gen-") as tmp:
        gen = Path(tmp)
        if stale is not None:  # the old driver's files first; the current install then links over them
            (gen / "gputable.h").write_text(gpu_table_header(stale, cuda_version, gpus))
            _compile_libraries(libdir, gen, stale, STALE_LIBRARIES)
        (gen / "gputable.h").write_text(gpu_table_header(version, cuda_version, gpus))
        _compile_libraries(libdir, gen, version, None)
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


def build_driver_root(
    dest: Path,
    version: str,
    gpus: list[SimGpu],
    *,
    stale_version: str | None = None,
    cuda_version: int = DEFAULT_CUDA_VERSION,
) -> Path:
    """Build the driver root at `dest` (replacing one that is there) and return `dest`."""
    _build(Path(dest), version, gpus, stale_version, cuda_version, replace=True)
    return Path(dest)


def _build(
    dest: Path, version: str, gpus: list[SimGpu], stale: str | None, cuda_version: int, *, replace: bool
) -> None:
    _check_version(version, "version")
    if stale is not None:
        _check_version(stale, "stale_version")
        if stale == version:
            raise SimDriverError(f"stale_version {stale} must differ from version {version}")
    if shutil.which(CC) is None:
        raise SimDriverError(f"no C compiler {CC!r}: install Debian's gcc and libc6-dev")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        _populate(tmp, version, cuda_version, gpus, stale)
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


def gpus_from_profile(profile: str | Path) -> tuple[list[SimGpu], str, int]:
    """The GPUs, driver version and CUDA version of a simulated node profile (needs dra_gpu)."""
    # Imported here: the builder itself needs only the stdlib.
    from dra_gpu.discovery import discover_node

    inv = discover_node("simdriver", str(profile))
    gpus = [
        SimGpu(g.minor, g.uuid, g.product_name, g.pci_bus_id, (g.memory_bytes or 0) >> 20) for g in inv.gpus
    ]
    if inv.driver_version is None:
        raise SimDriverError(f"profile {profile}: no driverVersion")
    return gpus, inv.driver_version, inv.cuda_driver_version or DEFAULT_CUDA_VERSION


def cache_key(version: str, cuda_version: int, gpus: list[SimGpu], stale_version: str | None) -> str:
    """A hash of everything a root is made from: C sources, this builder, GPU table, versions."""
    h = hashlib.sha256()
    for path in sorted(SRC.iterdir()):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(Path(__file__).read_bytes())
    h.update(gpu_table_header(version, cuda_version, gpus).encode())
    h.update(f"stale={stale_version} arch={multiarch()}".encode())
    return h.hexdigest()[:16]


def ensure_driver_root(
    cache_dir: Path,
    profile: str | Path,
    version: str | None = None,
    stale_version: str | None = None,
) -> Path:
    """`<cache_dir>/simdriver/<key>` for the profile, built once; a root that exists is complete."""
    gpus, profile_version, cuda_version = gpus_from_profile(profile)
    version = version or profile_version
    dest = Path(cache_dir) / "simdriver" / cache_key(version, cuda_version, gpus, stale_version)
    if not dest.is_dir():  # never replaced: someone may be using it
        _build(dest, version, gpus, stale_version, cuda_version, replace=False)
    return dest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="built-in profile name or profile file")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="build the root exactly here (replaced if present)")
    where.add_argument("--cache", type=Path, help="build once under CACHE/simdriver/<key>")
    ap.add_argument("--version", help="driver version (default: the profile's driverVersion)")
    ap.add_argument("--stale-version", help="also leave this older driver's libcuda/libnvidia-ml behind")
    args = ap.parse_args(argv)
    try:
        if args.cache is not None:
            root = ensure_driver_root(args.cache, args.profile, args.version, args.stale_version)
        else:
            gpus, version, cuda = gpus_from_profile(args.profile)
            root = build_driver_root(
                args.out, args.version or version, gpus, stale_version=args.stale_version, cuda_version=cuda
            )
    except SimDriverError as exc:
        print(f"simdriver: {exc}", file=sys.stderr)
        return 1
    print(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
