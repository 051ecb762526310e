"""The NVIDIA driver's user space on this node: which files of the running driver version exist.

A container gets a working GPU only with the host driver's own libraries (`libcuda.so.1`,
`libnvidia-ml.so.1`, ...), binaries (`nvidia-smi`, ...), GSP firmware and IPC sockets, all of the
exact version of the loaded kernel module (NVML's driver version); never the image's copies.
These files are the same for every claim on a node, so they are found once (`DriverFiles`), turned
into CDI container edits once, and the same edits go into every claim's spec.
The CDI edits that give them to a container are `dra_gpu.plugin.driver_files`.

Layouts found (paths relative to the driver root):
- Ubuntu's packages and NVIDIA's `.run` installer: libraries in `usr/lib/x86_64-linux-gnu/` (RHEL
  and the installer's default on other distributions: `usr/lib64/`), binaries in `usr/bin/`;
- Debian's packages: libraries in `usr/lib/x86_64-linux-gnu/nvidia/current/`, reached from
  `usr/lib/x86_64-linux-gnu/` and `usr/bin/` through the alternatives system's absolute links
  (`usr/bin/nvidia-smi -> /etc/alternatives/nvidia--nvidia-smi -> /usr/lib/nvidia/current/nvidia-smi`);
- GSP (`gsp_*.bin`) and, from R615, ucode (`ucodes_*.bin`) firmware in `lib/firmware/nvidia/<version>/`
  (Debian: `usr/lib/firmware/...` behind the merged-/usr `lib` link).
Every link is followed inside the driver root (`root_paths`), never in this process's own
filesystem: an absolute link names a path of the root's own system. A file is recorded by the path
it resolves to (what is mounted: the runtime resolves host paths in the host's namespace, where an
absolute link would name another file or none) and, when that differs, by the path it was found
through (`found_at`, `Library.links`: where a container expects it).
"""

from __future__ import annotations

import fnmatch
import logging
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dra_gpu.discovery.root_paths import RootPathError, resolve_in_root

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
    # GKE's driver installer (and images that carry the driver, as CUDA-style images expect it).
    "usr/local/nvidia/lib64",
)
BINARY_DIRS = (
    "usr/local/sbin",
    "usr/local/bin",
    "usr/sbin",
    "usr/bin",
    "sbin",
    "bin",
    "usr/local/nvidia/bin",
)
# GSP firmware; R615 adds ucode files: `ucodes_ga10x.bin`, `ucodes_tu10x.bin` (NVIDIA's changelog
# says `ucode_*.bin`; both names are matched).
FIRMWARE_PATTERNS = ("gsp*.bin", "ucode*.bin")
IPC_SOCKETS = (
    ("run/nvidia-persistenced/socket", "var/run/nvidia-persistenced/socket"),
    ("run/nvidia-fabricmanager/socket", "var/run/nvidia-fabricmanager/socket"),
)
_MAX_DIR_ENTRIES = 100_000  # a library directory larger than this is not a driver's


@dataclass(frozen=True)
class Library:
    name: str  # e.g. "libcuda.so"
    # The file, relative to the driver root, every link resolved inside it,
    # e.g. "usr/lib/x86_64-linux-gnu/libcuda.so.570.133.20"
    path: str
    soname: str | None  # from the ELF dynamic section, e.g. "libcuda.so.1"
    # Links in the library directories that resolve to it (root-relative, as found): the SONAME
    # and development links beside it, and Debian's alternatives links in the multiarch directory
    # (e.g. "usr/lib/x86_64-linux-gnu/libcuda.so.1" for ".../nvidia/current/libcuda.so.550.163.01").
    links: tuple[str, ...] = ()


@dataclass
class DriverInstallation:
    """What was found under one driver root for one driver version (paths relative to the root)."""

    root: str  # as the runtime sees it (host path)
    version: str
    libraries: list[Library] = field(default_factory=list)
    # Files, root-relative, every link resolved inside the root (what is mounted, and what this
    # process runs: no link is left in these paths).
    binaries: list[str] = field(default_factory=list)
    firmware: list[str] = field(default_factory=list)
    ipc_sockets: list[str] = field(default_factory=list)
    # file -> the path it was found through, where that differs (root-relative): where a
    # container expects it, e.g. "usr/lib/nvidia/current/nvidia-smi" -> "usr/bin/nvidia-smi".
    found_at: dict[str, str] = field(default_factory=dict)
    missing_optional: list[str] = field(default_factory=list)
    other_versions: list[str] = field(default_factory=list)  # left behind by an earlier driver
    error: str | None = None  # why no container can be given this installation

    def library_dirs(self) -> list[str]:
        return sorted({os.path.dirname(lib.path) for lib in self.libraries})

    def container_path(self, path: str) -> str:
        """Where a container gets the binary, firmware file or socket `path` (absolute)."""
        return "/" + self.found_at.get(path, path)

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
            "files": self.files(),
        }

    def files(self) -> list[dict[str, str]]:
        """Each file found: where a container expects it, and the file itself (root-relative,
        absolute), e.g. {"path": "/usr/bin/nvidia-smi", "file": "/usr/lib/nvidia/current/nvidia-smi"}."""
        out = [{"path": "/" + lib.path, "file": "/" + lib.path} for lib in self.libraries]
        for rel in [*self.binaries, *self.firmware, *self.ipc_sockets]:
            out.append({"path": self.container_path(rel), "file": "/" + rel})
        return out


def read_soname(path: Path) -> str | None:
    """DT_SONAME of an ELF shared object, or None (not ELF, or no SONAME).

    `path` must have no symbolic link left in it (see root_paths): the last one is refused here."""
    from elftools.common.exceptions import ELFError  # lazy: only needed at discovery
    from elftools.elf.dynamic import DynamicSegment
    from elftools.elf.elffile import ELFFile

    try:
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
            elf = ELFFile(f)
            for segment in elf.iter_segments():
                if isinstance(segment, DynamicSegment):
                    for tag in segment.iter_tags("DT_SONAME"):
                        soname = vars(tag).get("soname")  # set by pyelftools per tag
                        return str(soname) if soname else None
    except (ELFError, OSError, ValueError) as exc:
        log.warning("cannot read the ELF SONAME path=%s error=%s", path, exc)
    return None


def _resolve(root: Path, rel: str) -> str | None:
    """`rel` with every link followed inside `root` (root-relative), or None (nothing there, a loop)."""
    try:
        found = resolve_in_root(root, rel)
    except RootPathError as exc:
        log.warning("driver root path not resolvable root=%s path=/%s error=%s", root, rel, exc)
        return None
    return None if found is None or str(found) == "." else found.as_posix()


def _mode(root: Path, resolved: str) -> int | None:
    """st_mode of an already resolved root-relative path (its last part is never followed)."""
    try:
        return os.lstat(root / resolved).st_mode
    except OSError:
        return None


def _regular(root: Path, rel: str) -> str | None:
    """The regular file `rel` names inside `root`, resolved there (root-relative), or None."""
    resolved = _resolve(root, rel)
    mode = _mode(root, resolved) if resolved else None
    return resolved if mode is not None and stat.S_ISREG(mode) else None


def _directory(root: Path, rel: str) -> str | None:
    resolved = _resolve(root, rel)
    mode = _mode(root, resolved) if resolved else None
    return resolved if mode is not None and stat.S_ISDIR(mode) else None


def _entries(root: Path, directory: str) -> list[str]:
    """Names in a resolved root-relative directory (at most _MAX_DIR_ENTRIES), sorted."""
    names: list[str] = []
    try:
        with os.scandir(root / directory) as entries:
            for i, entry in enumerate(entries):
                if i >= _MAX_DIR_ENTRIES:
                    log.warning("directory too large, rest ignored root=%s dir=/%s", root, directory)
                    break
                names.append(entry.name)
    except OSError:
        pass
    return sorted(names)


def _versioned(name: str, base: str) -> str | None:
    """ "libcuda.so.570.133.20" -> "570.133.20" for base "libcuda.so"; None for "libcuda.so.1"."""
    rest = name[len(base) + 1 :] if name.startswith(base + ".") else ""
    # A driver version has at least two parts ("570.133.20"); "libcuda.so.1" is a SONAME link.
    return rest if rest.count(".") >= 1 and rest[0].isdigit() else None


def _library_dirs(root: Path) -> list[tuple[str, str]]:
    """(searched dir, the dir resolved inside the root) for each of LIBRARY_DIRS present, once each."""
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for rel in LIBRARY_DIRS:
        resolved = _directory(root, rel)
        if resolved is not None and resolved not in seen:
            seen.add(resolved)
            out.append((rel, resolved))
    return out


def _find_libraries(root: Path, version: str, found: DriverInstallation) -> set[str]:
    """Every `lib*.so.<version>` in the library dirs, with the links there that resolve to it;
    returns the library names found. Only what can matter is resolved (a host's library directory
    holds thousands of other libraries): files and links named for the version, libcuda's and
    libnvidia-ml's other versions, and then the links named after a library found."""
    suffix = ".so." + version
    by_path: dict[str, Library] = {}
    names: set[str] = set()
    other: set[str] = set()
    links: list[tuple[str, str]] = []  # (link path as searched, the link resolved to its directory)
    for searched, resolved_dir in _library_dirs(root):
        for entry in _entries(root, resolved_dir):
            if not entry.startswith("lib") or ".so" not in entry:
                continue
            rel = f"{resolved_dir}/{entry}"
            if stat.S_ISLNK(_mode(root, rel) or 0):
                links.append((f"{searched}/{entry}", rel))
            versions = [
                v for base in REQUIRED_LIBRARIES if (v := _versioned(entry, base)) not in (None, version)
            ]
            if not (entry.endswith(suffix) or versions):
                continue
            target = _regular(root, rel)
            if target is None:
                continue
            other.update(v for v in versions if v is not None)
            if not entry.endswith(suffix):
                continue
            name = entry[: -len(suffix)] + ".so"
            if name in names or target in by_path:
                continue  # the same library in two directories: the first one wins
            names.add(name)
            by_path[target] = Library(name=name, path=target, soname=read_soname(root / target))
    for link, rel in links:
        base = os.path.basename(link)
        if not any(base == name or base.startswith(name + ".") for name in names):
            continue
        lib = by_path.get(_regular(root, rel) or "")
        if lib is None or link == lib.path or not (base == lib.name or base.startswith(lib.name + ".")):
            continue
        if link not in lib.links:
            by_path[lib.path] = Library(lib.name, lib.path, lib.soname, (*lib.links, link))
    found.libraries = sorted(by_path.values(), key=lambda lib: lib.path)
    found.other_versions = sorted(other)
    return names


def _find_binaries(root: Path, found: DriverInstallation) -> None:
    for binary in BINARIES:
        for rel in BINARY_DIRS:
            searched = f"{rel}/{binary}"
            target = _regular(root, searched)
            if target is not None and (_mode(root, target) or 0) & 0o111:
                found.binaries.append(target)
                if target != searched:
                    found.found_at[target] = searched
                break
        else:
            found.missing_optional.append(binary)


def firmware_dirs() -> tuple[str, ...]:
    """Where the kernel looks for firmware, relative to the root, in its order (without the
    `firmware_class.path` module parameter, which names a path of the node, not of a driver root)."""
    release = os.uname().release
    return (
        f"lib/firmware/updates/{release}",
        "lib/firmware/updates",
        f"lib/firmware/{release}",
        "lib/firmware",
    )


def _find_firmware(root: Path, version: str, found: DriverInstallation) -> None:
    for rel in firmware_dirs():
        searched_dir = f"{rel}/nvidia/{version}"
        directory = _directory(root, searched_dir)
        if directory is None:
            continue
        for entry in _entries(root, directory):
            if not any(fnmatch.fnmatchcase(entry, pattern) for pattern in FIRMWARE_PATTERNS):
                continue
            searched = f"{searched_dir}/{entry}"
            target = _regular(root, searched)
            if target is not None and target not in found.firmware:
                found.firmware.append(target)
                if target != searched:
                    found.found_at[target] = searched
        if found.firmware:
            break


def _find_ipc_sockets(root: Path, found: DriverInstallation) -> None:
    for candidates in IPC_SOCKETS:
        for searched in candidates:
            target = _resolve(root, searched)
            if target is not None and stat.S_ISSOCK(_mode(root, target) or 0):
                found.ipc_sockets.append(target)
                if target != searched:
                    found.found_at[target] = searched
                break


def discover_installation(root: Path, version: str, host_root: str | None = None) -> DriverInstallation:
    """Find the user-space files of driver `version` under `root` (as this process sees it).

    `host_root` is the same root as the container runtime sees it (the plugin may run in a pod
    with the host's driver root mounted elsewhere); it defaults to `root`. Every path found is
    resolved inside `root` (root_paths): a link never leads out of it, into this process's own
    filesystem, and the paths recorded name the files themselves, so that the runtime, which
    resolves host paths in the host's namespace, mounts exactly the file found here.
    """
    found = DriverInstallation(root=host_root or str(root), version=version)
    names = _find_libraries(root, version, found)
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
    _find_binaries(root, found)
    _find_firmware(root, version, found)
    _find_ipc_sockets(root, found)
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
    for what, paths in (("binaries", found.binaries), ("firmware", found.firmware)):
        if paths:
            shown = [
                found.container_path(p) + ("" if p not in found.found_at else f" (-> /{p})") for p in paths
            ]
            yield f"  {what}: {', '.join(shown)}"
    if found.missing_optional and not found.error:
        yield f"  missing (optional): {', '.join(found.missing_optional)}"
    if found.other_versions:
        yield f"  other versions present: {', '.join(found.other_versions)}"
    if found.error:
        yield f"  ERROR: {found.error}"
