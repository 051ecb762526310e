#!/usr/bin/env python3
"""A host-like driver root: NVIDIA's real user space (550.163.01 or 535.261.03) with a simulated NVML.

    e2e/node/host_like_root.py [--profile hgx-2x4|dgx-h100-mig|NAME|FILE] [--suite trixie|bookworm]
                          [--cache-dir DIR] [--dev-dir DIR]

prints the path of a driver root that looks like a real Debian host with NVIDIA's driver
installed: a root of `e2e/node/debian_driver_root.py` (by default trixie's: NVIDIA's real 550.163.01
`libcuda`, `nvidia-smi` behind Debian's alternatives links, the MPS control daemon and server, GSP
firmware, and the root's own glibc 2.41, unlike the plugin image's; `--suite bookworm`: 535.261.03
and glibc 2.36), in which only Debian's
`usr/lib/x86_64-linux-gnu/nvidia/current/libnvidia-ml.so.<version>` is replaced by the simulated
NVML of `simnode` (compiled against NVIDIA's nvml.h) reporting the suite's driver version
and its CUDA version (12.4 for 550, 12.2 for 535) for the profile's GPUs. Same path, same file
name: Debian's alternatives links
(`usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1 -> /etc/alternatives/... -> nvidia/current/
libnvidia-ml.so.1 -> libnvidia-ml.so.550.163.01`) resolve to it, inside the root. Everything else
is NVIDIA's and Debian's real files.

The simulated NVML sees a GPU only through a character device 195:<minor> in its device directory
(`$DRA_GPU_SIM_DEV_DIR`, default `/dev`); `--dev-dir DIR` (or `make_dev_dir`) makes `nvidiactl`
and one node per GPU of the profile there (mknod: root). Its kernel-side state (MIG instances,
injected events) lives in `DIR/.nvidia-sim/`.

Cached as ${DRA_GPU_CACHE:-~/.cache/dra-gpu}/host-like-roots/<profile>[-bookworm]-<key>, <key> a hash of the
inputs (the Debian root's own key, the simulated library's bytes, the profile, this file's source);
built in a temporary directory beside it and renamed into place, with a manifest
`.dra-gpu-host-like-root.json` and a `.complete` marker; older roots of the profile are removed.

Importable: `host_like_root(profile, suite=...)` returns the root's Path (building what is missing: the
Debian root needs root, mmdebstrap and Debian's archive; the library a C compiler and NVIDIA's
nvml.h), `make_dev_dir(devdir, profile)` the device directory.

SAFETY: nothing here runs NVIDIA's binaries or loads its libraries (run as root on a host without
a driver, they create /dev/nvidiactl in the host's /dev).
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

E2E = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(E2E.parent))  # the checkout's dra_gpu, also when run as a script

from simnode.builder import default_cache_dir, ensure_nvml_library  # noqa: E402
from simnode.devnodes import make_device_nodes  # noqa: E402
from simnode.profiles import NodeProfile, load_profile  # noqa: E402

SUITE = "trixie"  # the default suite
# What NVIDIA's libcuda of each suite reports (cuDriverGetVersion): CUDA 12.4 (550), 12.2 (535).
CUDA_VERSIONS = {"550.163.01": 12040, "535.261.03": 12020}
DRIVER_VERSION = "550.163.01"  # the default suite's
CUDA_VERSION = CUDA_VERSIONS[DRIVER_VERSION]
PROFILES = ("hgx-2x4", "dgx-h100-mig")  # offered; any built-in name or profile file works
DEFAULT_PROFILE = "hgx-2x4"
NVML_DIR = "usr/lib/x86_64-linux-gnu/nvidia/current"
NVML_FILE = f"{NVML_DIR}/libnvidia-ml.so.{DRIVER_VERSION}"


def nvml_file(version: str) -> str:
    """Where Debian's package puts NVML of a driver version, relative to the root."""
    return f"{NVML_DIR}/libnvidia-ml.so.{version}"


MANIFEST = ".dra-gpu-host-like-root.json"
COMPLETE = ".complete"


class HostLikeRootError(RuntimeError):
    """The host-like root could not be built."""


def _debian_roots() -> ModuleType:
    """e2e/node/debian_driver_root.py (a script beside this one, not a package module)."""
    name = "debian_driver_root"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, E2E / "node" / "debian_driver_root.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def cache_dir() -> Path:
    base = os.environ.get("DRA_GPU_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dra-gpu")
    return Path(base) / "host-like-roots"


def driver_version(suite: str = SUITE) -> str:
    version: str = _debian_roots().suite_for(suite).driver_version
    return version


def node_profile(profile: str | Path, suite: str = SUITE) -> NodeProfile:
    """The profile, reporting the suite's NVIDIA driver and CUDA version instead of its own."""
    node = load_profile(str(profile))
    version = driver_version(suite)
    return dataclasses.replace(node, driver_version=version, cuda_driver_version=CUDA_VERSIONS[version])


def simulated_nvml(profile: str | Path, lib_cache: Path | None = None, suite: str = SUITE) -> Path:
    """The simulated libnvidia-ml.so.1 of the profile reporting the suite's driver (built once, cached)."""
    version = driver_version(suite)
    lib = ensure_nvml_library(lib_cache or default_cache_dir(), node_profile(profile, suite), version)
    return lib.resolve()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _label(profile: str | Path, suite: str = SUITE) -> str:
    name = Path(str(profile)).stem if str(profile) not in PROFILES else str(profile)
    suite_name: str = _debian_roots().suite_for(suite).name
    return name if suite_name == SUITE else f"{name}-{suite_name}"


def cache_key(debian_root: Path, nvml: Path, profile: str | Path) -> str:
    inputs = {
        "debianRoot": debian_root.name,  # <suite>-<its own key>
        "nvml": _sha256(nvml),
        "profile": str(profile),
        "builder": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def _build(debian_root: Path, nvml: Path, dest: Path, profile: str | Path, key: str, version: str) -> None:
    """Copy the Debian root into the empty directory dest and put the simulated NVML in place."""
    # GNU cp -a keeps links (Debian's absolute alternatives links), modes, owners and hard links.
    proc = subprocess.run(["cp", "-a", f"{debian_root}/.", str(dest)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise HostLikeRootError(f"copying {debian_root} failed: {proc.stderr.strip()}")
    for marker in (COMPLETE, _debian_roots().MANIFEST):
        (dest / marker).unlink(missing_ok=True)
    target = dest / nvml_file(version)
    if not target.is_file() or target.is_symlink():
        raise HostLikeRootError(
            f"{nvml_file(version)} is not a file in {debian_root}: not NVIDIA's Debian layout"
        )
    real_sha = _sha256(target)
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.copyfile(nvml, tmp)
    tmp.chmod(0o644)  # as Debian's package installs it
    os.replace(tmp, target)
    manifest = {
        "profile": str(profile),
        "driverVersion": version,
        "cudaDriverVersion": CUDA_VERSIONS[version],
        "key": key,
        "debianRoot": debian_root.name,
        "replaced": {
            "path": nvml_file(version),
            "debianSha256": real_sha,
            "simulatedSha256": _sha256(target),
        },
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    (dest / COMPLETE).write_text("")


def host_like_root(
    profile: str | Path = DEFAULT_PROFILE,
    base: Path | None = None,
    lib_cache: Path | None = None,
    suite: str = SUITE,
) -> Path:
    """The host-like root of a profile and suite (a Debian suite name or its driver version), built
    once per input hash; concurrent callers wait for one."""
    debian = _debian_roots()
    try:
        debian_root = Path(debian.driver_root(suite))
    except debian.DriverRootError as exc:
        raise HostLikeRootError(f"the Debian {suite} driver root: {exc}") from exc
    nvml = simulated_nvml(profile, lib_cache, suite)
    base = base or cache_dir()
    label = _label(profile, suite)
    key = cache_key(debian_root, nvml, profile)
    root = base / f"{label}-{key}"
    if (root / COMPLETE).is_file():
        return root
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f".{label}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / COMPLETE).is_file():
            return root
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=base))
        try:
            _build(debian_root, nvml, tmp, profile, key, driver_version(suite))
            tmp.chmod(0o755)
            if root.exists():  # an incomplete leftover of an interrupted rename
                shutil.rmtree(root)
            os.rename(tmp, root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in base.iterdir():  # one root a profile: the inputs moved on
            # <label>-<16 hex>, exactly: "hgx-2x4-" also begins "hgx-2x4-bookworm-<key>".
            if re.fullmatch(rf"{re.escape(label)}-[0-9a-f]{{16}}", old.name) and old != root and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
    return root


def manifest(root: Path) -> dict[str, object]:
    data: dict[str, object] = json.loads((root / MANIFEST).read_text())
    return data


def make_dev_dir(devdir: Path, profile: str | Path = DEFAULT_PROFILE) -> Path:
    """`devdir` with `nvidiactl` and `nvidia<minor>` for every GPU of the profile (char devices
    195:minor, made with mknod: root); the simulated NVML's $DRA_GPU_SIM_DEV_DIR."""
    return make_device_nodes(Path(devdir), [g.minor for g in load_profile(str(profile)).gpus])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help=f"simulated node profile (a built-in name such as {' or '.join(PROFILES)}, or a file; "
        "default %(default)s)",
    )
    ap.add_argument(
        "--suite",
        default=SUITE,
        help="Debian suite (trixie: 550.163.01, bookworm: 535.261.03; default %(default)s)",
    )
    ap.add_argument("--cache-dir", type=Path, help="default: $DRA_GPU_CACHE/host-like-roots")
    ap.add_argument("--dev-dir", type=Path, help="also make the simulated device nodes here (root)")
    ap.add_argument("--manifest", action="store_true", help="print the root's manifest after its path")
    args = ap.parse_args(argv)
    try:
        root = host_like_root(args.profile, args.cache_dir, suite=args.suite)
        if args.dev_dir:
            make_dev_dir(args.dev_dir, args.profile)
    except (HostLikeRootError, RuntimeError, OSError) as exc:
        print(f"host_like_root: {exc}", file=sys.stderr)
        return 1
    print(root)
    if args.manifest:
        print(json.dumps(manifest(root), indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
