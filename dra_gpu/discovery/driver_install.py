"""The NVIDIA driver's user space on this node: which files of the running driver version exist.

A container gets a working GPU only with the host driver's own libraries (`libcuda.so.1`,
`libnvidia-ml.so.1`, ...), binaries (`nvidia-smi`, ...), GSP firmware and IPC sockets, all of the
exact version of the loaded kernel module (NVML's driver version); never the image's copies.
These files are the same for every claim on a node, so they are found once (`DriverFiles`), turned
into CDI container edits once, and the same edits go into every claim's spec.
The CDI edits that give them to a container are `dra_gpu.plugin.driver_files`.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Libraries a CUDA or NVML program cannot do without; the rest are mounted when present.
REQUIRED_LIBRARIES = ("libcuda.so", "libnvidia-ml.so")
OPTIONAL_LIBRARIES = (
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libcudadebugger.so",
    "libnvidia-opencl.so",
    "libnvidia-gpucomp.so",
    "libnvidia-allocator.so",
    "libnvidia-cfg.so",
    "libnvidia-nscq.so",
    "libnvidia-pkcs11.so",
    "libnvidia-pkcs11-openssl3.so",
    "libnvidia-tileiras.so",
)
BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
# Where driver installers put libraries, relative to the driver root, in the order they are tried.
LIBRARY_DIRS = (
    "usr/lib64",
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib/x86_64-linux-gnu/nvidia/current",
    "usr/lib/aarch64-linux-gnu/nvidia/current",
    "lib64",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "lib/x86_64-linux-gnu/nvidia/current",
    "lib/aarch64-linux-gnu/nvidia/current",
)
BINARY_DIRS = ("usr/local/sbin", "usr/local/bin", "usr/sbin", "usr/bin", "sbin", "bin")
FIRMWARE_DIRS = ("lib/firmware/updates", "lib/firmware")
IPC_SOCKETS = (
    ("run/nvidia-persistenced/socket", "var/run/nvidia-persistenced/socket"),
    ("run/nvidia-fabricmanager/socket", "var/run/nvidia-fabricmanager/socket"),
)
_MAX_DIR_ENTRIES = 100_000  # a library directory larger than this is not a driver's


@dataclass(frozen=True)
class Library:
    name: str  # e.g. "libcuda.so"
    path: str  # relative to the driver root, e.g. "usr/lib/x86_64-linux-gnu/libcuda.so.570.133.20"
    soname: str | None  # from the ELF dynamic section, e.g. "libcuda.so.1"


@dataclass
class DriverInstallation:
    """What was found under one driver root for one driver version (paths relative to the root)."""

    root: str  # as the runtime sees it (host path)
    version: str
    libraries: list[Library] = field(default_factory=list)
    binaries: list[str] = field(default_factory=list)
    firmware: list[str] = field(default_factory=list)
    ipc_sockets: list[str] = field(default_factory=list)
    missing_optional: list[str] = field(default_factory=list)
    other_versions: list[str] = field(default_factory=list)  # left behind by an earlier driver
    error: str | None = None  # why no container can be given this installation

    def library_dirs(self) -> list[str]:
        return sorted({os.path.dirname(lib.path) for lib in self.libraries})

    def summary(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "version": self.version,
            "libraries": len(self.libraries),
            "binaries": len(self.binaries),
            "firmware": len(self.firmware),
            "ipcSockets": len(self.ipc_sockets),
            "libraryDirs": ["/" + d for d in self.library_dirs()],
            "missingOptional": list(self.missing_optional),
            "otherVersions": list(self.other_versions),
            "error": self.error,
        }


def read_soname(path: Path) -> str | None:
    """DT_SONAME of an ELF shared object, or None (not ELF, or no SONAME)."""
    from elftools.common.exceptions import ELFError  # lazy: only needed at discovery
    from elftools.elf.dynamic import DynamicSegment
    from elftools.elf.elffile import ELFFile

    try:
        with path.open("rb") as f:
            elf = ELFFile(f)
            for segment in elf.iter_segments():
                if isinstance(segment, DynamicSegment):
                    for tag in segment.iter_tags("DT_SONAME"):
                        soname = vars(tag).get("soname")  # set by pyelftools per tag
                        return str(soname) if soname else None
    except (ELFError, OSError, ValueError) as exc:
        log.warning("cannot read the ELF SONAME path=%s error=%s", path, exc)
    return None


def _is_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _library_versions(directory: Path, name: str) -> dict[str, Path]:
    """`<name>.<version>` files in `directory` -> version ("libcuda.so.570.133.20" -> "570.133.20")."""
    out: dict[str, Path] = {}
    try:
        entries = os.scandir(directory)
    except OSError:
        return out
    with entries:
        for i, entry in enumerate(entries):
            if i >= _MAX_DIR_ENTRIES:
                break
            rest = entry.name[len(name) + 1 :] if entry.name.startswith(name + ".") else ""
            # A driver version has at least two dots ("570.133.20"); "libcuda.so.1" is a link.
            if rest.count(".") >= 1 and rest[0].isdigit() and _is_file(Path(entry.path)):
                out[rest] = Path(entry.path)
    return out


def discover_installation(root: Path, version: str, host_root: str | None = None) -> DriverInstallation:
    """Find the user-space files of driver `version` under `root` (as this process sees it).

    `host_root` is the same root as the container runtime sees it (the plugin may run in a pod
    with the host's driver root mounted elsewhere); it defaults to `root`.
    """
    found = DriverInstallation(root=host_root or str(root), version=version)
    suffix = ".so." + version
    lib_dirs: list[str] = []
    seen_dirs: set[str] = set()
    other: set[str] = set()
    for rel in LIBRARY_DIRS:
        directory = root / rel
        try:
            real = os.path.realpath(directory)
        except OSError:
            continue
        if real in seen_dirs or not os.path.isdir(real):
            continue
        seen_dirs.add(real)
        for name in REQUIRED_LIBRARIES:
            versions = _library_versions(directory, name)
            other.update(v for v in versions if v != version)
            if version in versions and rel not in lib_dirs:
                lib_dirs.append(rel)
    found.other_versions = sorted(other)
    # Every library of this version in the driver's directories is mounted, like NVIDIA's
    # toolkit does; the named optional ones are only reported when absent.
    names: set[str] = set()
    for rel in lib_dirs:
        with os.scandir(root / rel) as entries:
            for i, entry in enumerate(entries):
                if i >= _MAX_DIR_ENTRIES:
                    break
                if entry.name.endswith(suffix) and _is_file(Path(entry.path)):
                    name = entry.name[: -len(suffix)] + ".so"
                    if name in names:
                        continue  # the same library in two directories: the first one wins
                    names.add(name)
                    found.libraries.append(
                        Library(name=name, path=f"{rel}/{entry.name}", soname=read_soname(Path(entry.path)))
                    )
    found.libraries.sort(key=lambda lib: lib.path)
    missing_required = [n for n in REQUIRED_LIBRARIES if n not in names]
    found.missing_optional = [f"{n}.{version}" for n in OPTIONAL_LIBRARIES if n not in names]
    for lib in found.libraries:
        if lib.name in REQUIRED_LIBRARIES and lib.soname is None:
            found.error = f"{lib.path} under {found.root} has no ELF SONAME; it is not a usable library"
    if missing_required:
        files = ", ".join(f"{n}.{version}" for n in missing_required)
        if found.other_versions:
            found.error = (
                f"driver version mismatch: the loaded kernel module is {version} (NVML), but the "
                f"driver libraries under {found.root} are version {', '.join(found.other_versions)} "
                f"({files} not found)"
            )
        else:
            found.error = (
                f"driver libraries not found: no {files} under {found.root} "
                f"(searched {', '.join('/' + d for d in LIBRARY_DIRS)})"
            )
    for binary in BINARIES:
        for rel in BINARY_DIRS:
            path = root / rel / binary
            if _is_file(path) and os.access(path, os.X_OK):
                found.binaries.append(f"{rel}/{binary}")
                break
        else:
            found.missing_optional.append(binary)
    for rel in FIRMWARE_DIRS:
        fw_dir = root / rel / "nvidia" / version
        if fw_dir.is_dir():
            found.firmware = sorted(
                f"{rel}/nvidia/{version}/{p.name}" for p in fw_dir.glob("gsp*.bin") if _is_file(p)
            )
            if found.firmware:
                break
    for candidates in IPC_SOCKETS:
        for rel in candidates:
            try:
                if stat.S_ISSOCK(os.stat(root / rel).st_mode):
                    found.ipc_sockets.append(rel)
                    break
            except OSError:
                continue
    return found


def describe(found: DriverInstallation | None, root: str) -> Iterable[str]:
    """Human-readable lines for `dra-gpu inventory`."""
    if found is None:
        yield f"Driver installation (root {root}): no driver version known"
        return
    yield (
        f"Driver installation (root {found.root}): version {found.version}, "
        f"{len(found.libraries)} libraries, {len(found.binaries)} binaries, "
        f"{len(found.firmware)} firmware files, {len(found.ipc_sockets)} IPC sockets"
    )
    if found.missing_optional and not found.error:
        yield f"  missing (optional): {', '.join(found.missing_optional)}"
    if found.other_versions:
        yield f"  other versions present: {', '.join(found.other_versions)}"
    if found.error:
        yield f"  ERROR: {found.error}"
