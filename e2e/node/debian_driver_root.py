#!/usr/bin/env python3
"""Driver roots holding NVIDIA's real user space, from Debian's NVIDIA packages (Python stdlib only).

    e2e/node/debian_driver_root.py SUITE|VERSION [--mirror URL] [--cache-dir DIR] [--manifest]

prints the path of a driver root: a Debian root made by `mmdebstrap` from Debian's archive with
`main contrib non-free non-free-firmware`, into which dpkg installed NVIDIA's driver user space as on
a real Debian host (maintainer scripts and the `nvidia-alternative` / `glx-alternative` alternatives
ran, so `/usr/bin/nvidia-smi` is the alternatives symlink chain a real host has):

| suite    | driver     | extra                                                  |
|----------|------------|--------------------------------------------------------|
| bookworm | 535.261.03 | nvidia-persistenced 535.171.04 (contrib, its own version) |
| trixie   | 550.163.01 | nvidia-persistenced 550.163.01 (contrib)                |

Packages: libcuda1 libnvidia-ml1 nvidia-smi nvidia-cuda-mps libnvidia-ptxjitcompiler1
firmware-nvidia-gsp nvidia-persistenced, and what they depend on (nvidia-alternative and the
glx-alternative machinery, libnvidia-pkcs11-openssl3, libnvidia-cfg1, nvidia-legacy-check, ...);
no Recommends (no kernel module, no dkms). Variant `essential` (no apt in the root), no docs, man
pages, info or locales.

The root is cached as ${DRA_GPU_CACHE:-$HOME/.cache/dra-gpu}/debian-driver-roots/<suite>-<key>,
<key> a hash of the inputs (suite, packages, expected version, this file's source); it is built in
a temporary directory beside it and renamed into place, with a `.complete` marker and a manifest
`.dra-gpu-driver-root.json` at its top (the exact installed versions from `dpkg-query`, the build
time and size). Building fails, naming the package, when Debian's archive no longer carries the
expected driver version. $E2E_DEBIAN_MIRROR overrides the mirror (where, not what: not in the key).

Importable: `driver_root("trixie")` returns the root's Path, building it when it is not cached;
`cached_driver_root("trixie")` returns it only when already built (None otherwise).

SAFETY: nothing here runs NVIDIA's binaries or initialises its libraries (run as root on a host
without a driver, they create /dev/nvidiactl in the host's /dev). Only dpkg's maintainer scripts
run, inside the root.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # e2e/node/images.py, also when loaded by path
import images  # the Debian test images' mirror and mmdebstrap filters

DEBIAN_MIRROR = images.DEBIAN_MIRROR
COMPONENTS = "main,contrib,non-free,non-free-firmware"
# The driver's user space a node needs: CUDA and NVML, nvidia-smi, MPS, the PTX JIT, GSP firmware,
# and the persistence daemon (packaged separately, in contrib, with its own version).
DRIVER_PACKAGES = (
    "libcuda1",
    "libnvidia-ml1",
    "nvidia-smi",
    "nvidia-cuda-mps",
    "libnvidia-ptxjitcompiler1",
    "firmware-nvidia-gsp",
)
EXTRA_PACKAGES = ("nvidia-persistenced",)
# Every installed package built from this source must carry the expected driver version.
DRIVER_SOURCE = "nvidia-graphics-drivers"


@dataclass(frozen=True)
class Suite:
    name: str
    driver_version: str  # upstream version, e.g. "535.261.03"


SUITES = {
    "bookworm": Suite("bookworm", "535.261.03"),
    "trixie": Suite("trixie", "550.163.01"),
}

# No docs, man pages, info or locales in the root (the copyrights stay), as in the test images;
# nor lintian's or reportbug's data.
PATH_FILTERS = [
    *images.MMDEBSTRAP_PATH_FILTERS,
    *(f"--dpkgopt=path-exclude=/usr/share/{path}" for path in ("lintian/*", "bug/*")),
]
MANIFEST = ".dra-gpu-driver-root.json"
COMPLETE = ".complete"


class DriverRootError(RuntimeError):
    """A driver root could not be built, or is not what was asked for."""


def cache_dir() -> Path:
    base = os.environ.get("DRA_GPU_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dra-gpu")
    return Path(base) / "debian-driver-roots"


def suite_for(name_or_version: str) -> Suite:
    """A suite by its name ("trixie") or its driver version ("550.163.01")."""
    for suite in SUITES.values():
        if name_or_version in (suite.name, suite.driver_version):
            return suite
    known = ", ".join(f"{s.name} ({s.driver_version})" for s in SUITES.values())
    raise DriverRootError(f"unknown suite or driver version {name_or_version!r}; known: {known}")


def packages(suite: Suite) -> list[str]:
    return [*DRIVER_PACKAGES, *EXTRA_PACKAGES]


def mmdebstrap_args(suite: Suite) -> list[str]:
    """mmdebstrap's options, target and mirror excluded (they are not part of the cache key)."""
    return [
        "--variant=essential",
        f"--components={COMPONENTS}",
        "--include=" + ",".join(packages(suite)),
        "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
        *PATH_FILTERS,
    ]


def cache_key(suite: Suite) -> str:
    inputs = {
        "suite": suite.name,
        "driver": suite.driver_version,
        "packages": packages(suite),
        "args": mmdebstrap_args(suite),
        "builder": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def root_path(suite: Suite, base: Path | None = None) -> Path:
    return (base or cache_dir()) / f"{suite.name}-{cache_key(suite)}"


def cached_driver_root(name_or_version: str, base: Path | None = None) -> Path | None:
    """The root when it is already built and complete, else None (never builds)."""
    root = root_path(suite_for(name_or_version), base)
    return root if (root / COMPLETE).is_file() else None


def installed_packages(root: Path) -> dict[str, dict[str, str]]:
    """package -> {version, source} of every package dpkg installed in the root."""
    proc = subprocess.run(
        [
            "dpkg-query",
            f"--admindir={root / 'var/lib/dpkg'}",
            "-W",
            "-f=${db:Status-Status}\t${Package}\t${Version}\t${source:Package}\n",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    out: dict[str, dict[str, str]] = {}
    for line in proc.stdout.splitlines():
        status, name, version, source = line.split("\t")
        if status == "installed":
            out[name] = {"version": version, "source": source}
    return out


def upstream_version(debian_version: str) -> str:
    """'535.261.03-1' -> '535.261.03' (no epoch, no Debian revision)."""
    version = debian_version.split(":", 1)[-1]
    return version.rsplit("-", 1)[0] if "-" in version else version


def check_versions(suite: Suite, installed: dict[str, dict[str, str]]) -> None:
    """Every asked-for package is installed; every package of NVIDIA's driver source has its version."""
    missing = [p for p in packages(suite) if p not in installed]
    if missing:
        raise DriverRootError(f"{suite.name}: packages not installed: {', '.join(missing)}")
    wrong = {
        name: info["version"]
        for name, info in sorted(installed.items())
        if info["source"] == DRIVER_SOURCE and upstream_version(info["version"]) != suite.driver_version
    }
    if wrong:
        listed = ", ".join(f"{n} {v}" for n, v in wrong.items())
        raise DriverRootError(
            f"{suite.name}: Debian's archive no longer carries NVIDIA {suite.driver_version}: "
            f"installed {listed}; update SUITES in e2e/node/debian_driver_root.py (and the tests that "
            "name the version)"
        )


def root_nvml(root: Path, suite: Suite) -> Path:
    """The real libnvidia-ml.so.<version> in Debian's layout."""
    return root / "usr/lib/x86_64-linux-gnu/nvidia/current" / f"libnvidia-ml.so.{suite.driver_version}"


def tree_size(root: Path) -> int:
    """Bytes of the root's files (symlinks and hard links counted once, not followed)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def build(suite: Suite, dest: Path, mirror: str = DEBIAN_MIRROR) -> dict[str, object]:
    """Run mmdebstrap into the empty or missing directory dest; return the manifest (not written)."""
    if shutil.which("mmdebstrap") is None:
        raise DriverRootError(
            "building a Debian driver root needs mmdebstrap (e2e/node/build.sh debs installs it)"
        )
    if os.geteuid() != 0:
        raise DriverRootError("building a Debian driver root needs root (mmdebstrap's root mode runs dpkg)")
    cmd = ["mmdebstrap", "--quiet", *mmdebstrap_args(suite), suite.name, str(dest), mirror]
    t0 = time.monotonic()
    env = dict(os.environ, SOURCE_DATE_EPOCH="0")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = round(time.monotonic() - t0, 1)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise DriverRootError(f"mmdebstrap {suite.name} failed ({proc.returncode}):\n{tail}")
    installed = installed_packages(dest)
    check_versions(suite, installed)
    nvml = root_nvml(dest, suite)
    if not nvml.is_file():
        raise DriverRootError(f"{suite.name}: {nvml.relative_to(dest)} missing after install")
    return {
        "suite": suite.name,
        "driverVersion": suite.driver_version,
        "key": cache_key(suite),
        "mirror": mirror,
        "mmdebstrap": subprocess.run(
            ["mmdebstrap", "--version"], capture_output=True, text=True, check=False
        ).stdout.strip(),
        "requested": packages(suite),
        "packages": installed,
        "buildSeconds": seconds,
        "sizeBytes": tree_size(dest),
        "nvml": str(nvml.relative_to(dest)),
    }


def driver_root(name_or_version: str, base: Path | None = None, mirror: str = DEBIAN_MIRROR) -> Path:
    """The driver root of a suite, built once per input hash; concurrent callers wait for one build."""
    suite = suite_for(name_or_version)
    base = base or cache_dir()
    root = root_path(suite, base)
    if (root / COMPLETE).is_file():
        return root
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f".{suite.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / COMPLETE).is_file():
            return root
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=base))
        try:
            manifest = build(suite, tmp, mirror)
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            (tmp / COMPLETE).write_text("")
            if root.exists():  # an incomplete leftover of an interrupted rename
                shutil.rmtree(root)
            os.rename(tmp, root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in base.iterdir():  # one root a suite: the inputs moved on
            if old.name.startswith(f"{suite.name}-") and old != root:
                shutil.rmtree(old, ignore_errors=True)
    return root


def manifest(root: Path) -> dict[str, object]:
    data: dict[str, object] = json.loads((root / MANIFEST).read_text())
    return data


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("suite", help="bookworm | trixie, or the driver version (535.261.03 | 550.163.01)")
    ap.add_argument("--mirror", default=DEBIAN_MIRROR, help="Debian mirror (default: %(default)s)")
    ap.add_argument("--cache-dir", type=Path, help="default: $DRA_GPU_CACHE/debian-driver-roots")
    ap.add_argument("--manifest", action="store_true", help="print the root's manifest after its path")
    args = ap.parse_args(argv)
    try:
        root = driver_root(args.suite, args.cache_dir, args.mirror)
    except DriverRootError as e:
        print(f"debian_driver_root: {e}", file=sys.stderr)
        return 1
    print(root)
    if args.manifest:
        print(json.dumps(manifest(root), indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
