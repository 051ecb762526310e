"""NVIDIA's own CDI spec generator as the reference for ours, over NVIDIA's real Debian packages.

`nvidia-ctk cdi generate --mode=management` (NVIDIA's container toolkit, built from its Go module
by `e2e/node/build.sh toolkit`) runs over the Debian driver roots of `e2e/node/debian_driver_root.py`
(bookworm 535.261.03, trixie 550.163.01) with a dev root of real character devices made here.
Our spec for the same root is what a claim of one GPU gets: the driver's user space
(`driver_files.container_edits`, with the same hook program) composed with the claim's own part
(`CdiSpecs.build`: the GPU's node, the control nodes of `DeviceNodes`, the env prepare sets).

The two are compared entry by entry (mounts by container path and the file they mount, device
nodes, env vars, hooks, and every link NVIDIA's `create-symlinks` hook would make): each entry of
NVIDIA's spec is in ours, or DIFFERENCES says why not; each entry only ours has is in DIFFERENCES
with the reason. A row no root needs any more fails too, so the table stays the true list (the
driver-files section of docs/operations.md has the same table).

SAFETY: `nvidia-ctk cdi generate` asks NVML for the driver version (`nvmlInit` of the root's real
libnvidia-ml), which as root on a machine without a driver creates /dev/nvidiactl. It runs here in
a private mount namespace over a tmpfs /dev (`unshare --mount`), and the test checks that the
machine's own /dev has no new NVIDIA node afterwards. That needs root; so does the dev root's
mknod. Without root the test is skipped, saying so; a toolkit that cannot be built fails it.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from dra_gpu.discovery.driver_install import discover_installation
from dra_gpu.discovery.root_paths import resolve_in_root
from dra_gpu.plugin.cdi import CdiDevice, CdiSpecs, visible_devices_env
from dra_gpu.plugin.device_nodes import DeviceNodes
from dra_gpu.plugin.driver_files import CUDA_STYLE_BIN_DIR, CUDA_STYLE_LIB_DIR, container_edits
from tests.driver_root import debian_driver_roots, debian_root

REPO = Path(__file__).resolve().parents[1]
HOOK = "/usr/bin/nvidia-cdi-hook"
UUID = "GPU-5f2a39c4-1f9b-4c6e-9d1a-3e8b2f6a7c01"
DEBIAN = [(s.name, s.driver_version) for s in debian_driver_roots().SUITES.values()]
# The dev root: the nodes a node with two GPUs has (majors as a real node: nvidia 195, the uvm
# module's dynamic major as /proc/devices would give it).
DEV_NODES = {
    "nvidiactl": (195, 255),
    "nvidia-modeset": (195, 254),
    "nvidia0": (195, 0),
    "nvidia1": (195, 1),
    "nvidia-uvm": (510, 0),
    "nvidia-uvm-tools": (510, 1),
}


@dataclass(frozen=True)
class Difference:
    side: str  # "nvidia": only NVIDIA's spec has it; "ours": only ours
    kind: str  # "mount" (by container path), "deviceNode", "env" (by name), "hook" (by name), "link"
    pattern: str  # fnmatch pattern over the entry's key
    reason: str


DIFFERENCES = (
    # ---- only in NVIDIA's spec
    Difference(
        "nvidia",
        "env",
        "NVIDIA_CTK_LIBCUDA_DIR=*",
        "the driver's library directories, for programs in the container; nothing of toolkit v1.20.2 "
        "itself reads it, and ours gives the libraries at their own paths (and through update-ldcache)",
    ),
    Difference(
        "nvidia",
        "deviceNode",
        "/dev/nvidia1",
        "management mode gives every GPU of the node; a claim gets only its own GPUs' nodes",
    ),
    # ---- only in ours
    Difference(
        "ours",
        "hook",
        "disable-device-node-modification",
        "NVIDIA's management mode leaves it out (a management container may make device nodes); its "
        "nvml mode, what NVIDIA's DRA driver uses for a workload, adds it as ours does: NVIDIA's "
        "libraries in the container may not create device nodes",
    ),
    Difference(
        "ours",
        "env",
        "DRA_GPU_VISIBLE_DEVICES=GPU-*",
        "the claim's GPU UUIDs, for programs that want them (NVIDIA_VISIBLE_DEVICES is 'void', as in "
        "NVIDIA's spec, so an NVIDIA runtime on the node injects nothing a second time)",
    ),
    Difference(
        "ours",
        "mount",
        "/usr/bin/nvidia-smi",
        "NVIDIA misses nvidia-smi behind Debian's alternatives link (/usr/bin/nvidia-smi -> "
        "/etc/alternatives/... is followed in the generating process's own filesystem); ours resolves "
        "it inside the driver root",
    ),
    Difference(
        "ours",
        "mount",
        f"{CUDA_STYLE_BIN_DIR}/*",
        "the binaries again where CUDA-style images put them on PATH (/usr/local/nvidia/bin)",
    ),
    Difference(
        "ours",
        "mount",
        f"{CUDA_STYLE_LIB_DIR}/*",
        "the libraries again at their SONAMEs where CUDA-style images put them on LD_LIBRARY_PATH",
    ),
    Difference(
        "ours",
        "mount",
        "/usr/lib/x86_64-linux-gnu/lib*.so*",
        "Debian's alternatives links in the multiarch directory (libcuda.so.1, libnvidia-ml.so.1, "
        "libnvidia-ptxjitcompiler.so.1, libnvidia-cfg.so.1, libcuda.so), mounted from the real files: "
        "a plain Debian/Ubuntu image's loader finds them without an ld cache update; NVIDIA's spec "
        "makes the links only beside the files in nvidia/current, which the default loader path lacks "
        "(it needs its update-ldcache hook)",
    ),
    Difference(
        "ours",
        "hook-folder",
        CUDA_STYLE_LIB_DIR,
        "update-ldcache also gets the CUDA-style library directory ours mounts the SONAMEs in",
    ),
)


# ---------------------------------------------------------------- running NVIDIA's generator


def _pin() -> str:
    text = (REPO / "e2e" / "node" / "versions.sh").read_text()
    match = re.search(r"^NVIDIA_CTK_VERSION=(\S+)", text, re.M)
    assert match, "e2e/node/versions.sh has no NVIDIA_CTK_VERSION"
    return match.group(1)


@cache
def nvidia_ctk() -> Path:
    """nvidia-ctk of the pinned toolkit: the cached build, else built by `e2e/node/build.sh toolkit`."""
    cache_dir = Path(os.environ.get("DRA_GPU_CACHE") or Path.home() / ".cache" / "dra-gpu")
    out = cache_dir / "bin" / f"nvidia-container-toolkit-{_pin()}"
    if not (out / ".complete").is_file():
        proc = subprocess.run(
            ["bash", str(REPO / "e2e" / "node" / "build.sh"), "toolkit"],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if proc.returncode != 0 or not (out / ".complete").is_file():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
            pytest.fail(
                f"cannot build NVIDIA's container toolkit {_pin()} (e2e/node/build.sh toolkit exited "
                f"{proc.returncode}; it needs Go, a C compiler and the Go module proxy):\n{tail}"
            )
    return out / "nvidia-ctk"


def _nvidia_nodes_on_this_machine() -> set[str]:
    return {p.name for p in Path("/dev").glob("nvidia*")}


def make_dev_root(path: Path) -> Path:
    dev = path / "dev"
    dev.mkdir(parents=True)
    for name, (major, minor) in DEV_NODES.items():
        os.mknod(dev / name, 0o666 | 0o020000, os.makedev(major, minor))
        os.chmod(dev / name, 0o666)
    return path


def nvidia_spec(root: Path, dev_root: Path, out: Path) -> dict[str, Any]:
    """NVIDIA's spec for the root, generated where NVML's side effects cannot reach /dev."""
    before = _nvidia_nodes_on_this_machine()
    script = 'mount -t tmpfs tmpfs /dev && mknod -m 666 /dev/null c 1 3 && exec "$@"'
    cmd = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        script,
        "sh",
        str(nvidia_ctk()),
        "--quiet",
        "cdi",
        "generate",
        "--mode=management",
        f"--driver-root={root}",
        f"--dev-root={dev_root}",
        f"--nvidia-cdi-hook-path={HOOK}",
        "--format=json",
        f"--output={out}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    created = _nvidia_nodes_on_this_machine() - before
    for name in created:  # never leave one behind, then fail
        (Path("/dev") / name).unlink()
    assert not created, f"nvidia-ctk created {sorted(created)} in this machine's /dev"
    assert proc.returncode == 0, proc.stderr[-3000:]
    spec: dict[str, Any] = json.loads(out.read_text())
    return spec


def our_spec(root: Path, version: str, dev_root: Path) -> dict[str, Any]:
    """What a claim of GPU 0 gets: the driver's edits composed with the claim's own part."""
    found = discover_installation(root, version)
    assert found.error is None
    nodes = DeviceNodes(dev_root)
    specs = CdiSpecs(Path("/nonexistent"), "gpu.dra-gpu.io")
    claim = specs.build(
        "6c2a1f7e-0d4b-4f3a-9c8e-5b7d1a2e3f40",
        [CdiDevice("gpu-0", [nodes.node("/dev/nvidia0")])],
        nodes.control(),
        visible_devices_env([UUID]),  # as prepare sets it
    )
    return CdiSpecs.compose(claim, container_edits(found, HOOK))


# ---------------------------------------------------------------- entries


def all_edits(spec: dict[str, Any]) -> dict[str, list[Any]]:
    """Spec-level and device-level edits together (NVIDIA puts device nodes in its 'all' device)."""
    out: dict[str, list[Any]] = {}
    for edits in [spec.get("containerEdits", {})] + [d["containerEdits"] for d in spec["devices"]]:
        for key, value in edits.items():
            out.setdefault(key, []).extend(value)
    return out


def _file(root: Path, host_path: str) -> str:
    """The file a mount's host path names, resolved inside the root ('/dev/null' as is)."""
    if not host_path.startswith(f"{root}/"):
        return host_path
    resolved = resolve_in_root(root, host_path[len(str(root)) + 1 :])
    assert resolved is not None, f"{host_path} names nothing"
    return "/" + resolved.as_posix()


def hook_name(hook: dict[str, Any]) -> str:
    args = hook["args"]
    return str(args[2] if args[1] == "hook" else args[1])


def entries(spec: dict[str, Any], root: Path) -> dict[tuple[str, str], str]:
    """(kind, key) -> value: what is compared."""
    edits = all_edits(spec)
    out: dict[tuple[str, str], str] = {}
    for m in edits.get("mounts", []):
        out[("mount", m["containerPath"])] = _file(root, m["hostPath"])
    for node in edits.get("deviceNodes", []):
        out[("deviceNode", node["path"])] = node.get("hostPath", node["path"])
    for env in edits.get("env", []):
        out[("env", env)] = env
    for hook in edits.get("hooks", []):
        assert hook["path"] == HOOK and hook["hookName"] == "createContainer", hook
        name = hook_name(hook)
        args = hook["args"]
        # The hook and its own arguments (update-ldcache's folders and create-symlinks' links are
        # compared one by one below).
        rest = args[args.index(name) + 1 :]
        out[("hook", name)] = " ".join(
            [name] + ([] if name in ("update-ldcache", "create-symlinks") else rest)
        )
        if name == "update-ldcache":
            folders = [args[i + 1] for i, a in enumerate(args) if a == "--folder"]
            for folder in folders:
                out[("hook-folder", folder)] = folder
        if name == "create-symlinks":
            for i, a in enumerate(args):
                if a == "--link":
                    target, link = args[i + 1].split("::")
                    out[("link", link)] = target
    return out


def _declared(side: str, kind: str, key: str) -> Difference | None:
    return next(
        (d for d in DIFFERENCES if d.side == side and d.kind == kind and fnmatch.fnmatchcase(key, d.pattern)),
        None,
    )


def compare(nvidia: dict[str, Any], ours: dict[str, Any], root: Path) -> tuple[list[str], set[Difference]]:
    """Undeclared differences (empty when the specs agree up to DIFFERENCES) and the rows used."""
    theirs, mine = entries(nvidia, root), entries(ours, root)
    problems: list[str] = []
    used: set[Difference] = set()
    for (kind, key), value in sorted(theirs.items()):
        if kind == "link":
            # NVIDIA's create-symlinks makes `key` point at `value` (relative to its directory):
            # ours must mount the same file there.
            target = theirs.get(("mount", os.path.join(os.path.dirname(key), value)))
            target = target or _file(root, f"{root}{os.path.join(os.path.dirname(key), value)}")
            # With the hook program ours makes the same link; without, it mounts the file there.
            if mine.get(("link", key)) != value and mine.get(("mount", key)) != target:
                problems.append(
                    f"NVIDIA links {key} -> {value}; ours links {mine.get(('link', key))}, "
                    f"mounts {mine.get(('mount', key))} there"
                )
            continue
        if mine.get((kind, key)) == value:
            continue
        row = _declared("nvidia", kind, key)
        if row is None:
            got = mine.get((kind, key))
            problems.append(
                f"only NVIDIA's spec has {kind} {key} ({value})" + (f"; ours: {got}" if got else "")
            )
        else:
            used.add(row)
    for (kind, key), value in sorted(mine.items()):
        if (kind, key) in theirs and theirs[(kind, key)] == value:
            continue
        if kind == "mount" and ("link", key) in theirs:
            continue  # NVIDIA makes it a link to the same file (checked above)
        row = _declared("ours", kind, key)
        if row is None:
            problems.append(f"only our spec has {kind} {key} ({value}), and no row of DIFFERENCES says why")
        else:
            used.add(row)
    return problems, used


# ---------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def privileged() -> None:
    if os.geteuid() != 0:
        pytest.skip(
            "needs root: the dev root's device nodes (mknod) and a private mount namespace for nvidia-ctk"
        )
    if shutil.which("unshare") is None:
        pytest.fail("needs unshare (util-linux) to keep nvidia-ctk's NVML out of this machine's /dev")


@pytest.mark.parametrize(("suite", "version"), DEBIAN, ids=[s for s, _ in DEBIAN])
def test_our_spec_has_what_nvidias_has_or_says_why(
    suite: str, version: str, tmp_path: Path, privileged: None
) -> None:
    root = debian_root(suite)
    dev_root = make_dev_root(tmp_path / "devroot")
    nvidia = nvidia_spec(root, dev_root, tmp_path / "nvidia.json")
    ours = our_spec(root, version, dev_root)
    # What NVIDIA's generator found in the root, as measured (so a toolkit that finds more or less
    # shows up here, not as a silently shorter comparison).
    theirs = entries(nvidia, root)
    mounted = {key for kind, key in theirs if kind == "mount"}
    assert f"/usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so.{version}" in mounted
    assert "/usr/sbin/nvidia-cuda-mps-server" in mounted
    assert f"/lib/firmware/nvidia/{version}/gsp_ga10x.bin" in mounted
    assert "/usr/bin/nvidia-smi" not in mounted  # NVIDIA's miss behind Debian's alternatives
    assert nvidia["cdiVersion"] == "0.5.0"
    problems, used = compare(nvidia, ours, root)
    assert not problems, "\n".join(problems)
    unused = [d for d in DIFFERENCES if d not in used]
    assert not unused, f"rows of DIFFERENCES no difference needs any more: {unused}"


def test_the_operations_page_lists_every_difference() -> None:
    page = (REPO / "docs" / "operations.md").read_text()
    for d in DIFFERENCES:
        assert f"`{d.pattern}`" in page, f"docs/operations.md's driver-files table lacks {d.kind} {d.pattern}"
