"""Driver installation discovery and the CDI edits made from it, on driver roots built here.

The libraries are real ELF shared objects compiled by the C compiler (their SONAME is read from
the ELF dynamic section, as the loader does); layouts are those of Debian and RHEL installers.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest

from dra_gpu.discovery.driver_install import discover_installation
from dra_gpu.plugin.driver_files import (
    CUDA_STYLE_BIN_DIR,
    CUDA_STYLE_LIB_DIR,
    DriverFiles,
    DriverInstallationError,
    container_edits,
)
from tests.driver_root import DEB, make_root

V = "570.133.20"
OLD = "550.54.15"

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


def test_finds_the_running_versions_files_with_their_sonames(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root")
    found = discover_installation(root, V)
    assert found.error is None
    libs = {lib.name: lib for lib in found.libraries}
    assert set(libs) == {"libcuda.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so"}
    assert libs["libcuda.so"].path == f"{DEB}/libcuda.so.{V}"
    assert libs["libcuda.so"].soname == "libcuda.so.1"
    assert found.binaries == ["usr/bin/nvidia-smi", "usr/bin/nvidia-cuda-mps-control"]
    assert found.firmware == [f"lib/firmware/nvidia/{V}/gsp_ga10x.bin"]
    assert "nvidia-debugdump" in found.missing_optional
    assert f"libnvidia-nvvm.so.{V}" in found.missing_optional
    assert found.summary()["libraryDirs"] == [f"/{DEB}"]


def test_stale_libraries_of_an_older_driver_are_neither_mounted_nor_followed(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root", OLD)
    make_root(root, V)
    # The unversioned link still names the old driver, as an upgrade can leave it.
    (root / DEB / "libcuda.so").unlink()
    (root / DEB / "libcuda.so").symlink_to(f"libcuda.so.{OLD}")
    found = discover_installation(root, V)
    assert found.error is None
    assert found.other_versions == [OLD]
    assert all(lib.path.endswith(V) for lib in found.libraries)
    edits = container_edits(found)
    cuda = [m for m in edits["mounts"] if m["containerPath"].endswith("/libcuda.so")]
    assert cuda == [
        {
            "hostPath": f"{root}/{DEB}/libcuda.so.{V}",
            "containerPath": f"/{DEB}/libcuda.so",
            "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"],
        }
    ]


def test_a_version_mismatch_names_both_versions(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root", OLD)
    found = discover_installation(root, V)
    assert found.error is not None
    assert "version mismatch" in found.error
    assert V in found.error and OLD in found.error
    files = DriverFiles(root, V)
    with pytest.raises(DriverInstallationError, match=f"kernel module is {V}.*version {OLD}"):
        files.edits()


def test_no_driver_at_all_says_where_it_looked(tmp_path: Path) -> None:
    found = discover_installation(tmp_path, V)
    assert found.error is not None and f"libcuda.so.{V}" in found.error and "/usr/lib64" in found.error


def test_a_required_library_without_soname_is_refused(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root", soname=False)
    found = discover_installation(root, V)
    assert found.error is not None and "no ELF SONAME" in found.error


def test_rhel_layout_and_a_driver_root_seen_elsewhere_on_the_host(tmp_path: Path) -> None:
    root = make_root(tmp_path / "driver-root", libdir="usr/lib64")
    found = discover_installation(root, V, host_root="/run/nvidia/driver")
    edits = container_edits(found)
    by_target = {m["containerPath"]: m["hostPath"] for m in edits["mounts"]}
    lib = f"/run/nvidia/driver/usr/lib64/libnvidia-ml.so.{V}"
    # Container path = host path minus the driver root; the SONAME beside it and in the
    # CUDA-image directory; binaries also where CUDA images put them on PATH.
    assert by_target[f"/usr/lib64/libnvidia-ml.so.{V}"] == lib
    assert by_target["/usr/lib64/libnvidia-ml.so.1"] == lib
    assert by_target[f"{CUDA_STYLE_LIB_DIR}/libnvidia-ml.so.1"] == lib
    assert by_target["/usr/bin/nvidia-smi"] == "/run/nvidia/driver/usr/bin/nvidia-smi"
    assert by_target[f"{CUDA_STYLE_BIN_DIR}/nvidia-smi"] == "/run/nvidia/driver/usr/bin/nvidia-smi"
    assert by_target[f"/lib/firmware/nvidia/{V}/gsp_ga10x.bin"].startswith("/run/nvidia/driver/lib/")
    assert "hooks" not in edits


def test_ipc_sockets_are_mounted_writable_and_the_hook_updates_the_ld_cache(tmp_path: Path) -> None:
    root = make_root(tmp_path / "r")
    sock_dir = root / "run/nvidia-persistenced"
    sock_dir.mkdir(parents=True)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock_dir / "socket"))
        found = discover_installation(root, V)
    assert found.ipc_sockets == ["run/nvidia-persistenced/socket"]
    edits = container_edits(found, hook_path="/usr/local/bin/nvidia-cdi-hook")
    sock = [m for m in edits["mounts"] if m["containerPath"] == "/run/nvidia-persistenced/socket"]
    assert sock and "ro" not in sock[0]["options"] and "noexec" in sock[0]["options"]
    hooks = {h["args"][1]: h for h in edits["hooks"]}
    # NVIDIA's default hooks for driver libraries, in its generator's order, all at createContainer.
    assert list(hooks) == [
        "create-symlinks",
        "enable-cuda-compat",
        "update-ldcache",
        "disable-device-node-modification",
    ]
    assert {h["hookName"] for h in hooks.values()} == {"createContainer"}
    assert hooks["update-ldcache"]["args"] == [
        "nvidia-cdi-hook",
        "update-ldcache",
        "--folder",
        f"/{DEB}",
        "--folder",
        CUDA_STYLE_LIB_DIR,
    ]
    assert hooks["enable-cuda-compat"]["args"][2:] == [f"--host-driver-version={V}"]
    assert hooks["disable-device-node-modification"]["args"][2:] == []
    links = hooks["create-symlinks"]["args"][2:]
    assert links[0::2] == ["--link"] * (len(links) // 2)
    made = dict(reversed(x.split("::")) for x in links[1::2])
    assert made[f"/{DEB}/libcuda.so.1"] == f"libcuda.so.{V}"
    assert made[f"/{DEB}/libcuda.so"] == "libcuda.so.1"
    assert made[f"/{DEB}/libnvidia-ml.so.1"] == f"libnvidia-ml.so.{V}"
    # A link the hook makes is not also a bind mount (the hook would fail to replace it).
    mounted = {m["containerPath"] for m in edits["mounts"]}
    assert not mounted & set(made)
    assert f"{CUDA_STYLE_LIB_DIR}/libcuda.so.1" in mounted  # CUDA-style images still find it
    ctk = container_edits(found, hook_path="/usr/bin/nvidia-ctk")["hooks"][0]["args"]
    assert ctk[:3] == ["nvidia-ctk", "hook", "create-symlinks"]


def test_a_broken_installation_is_looked_at_again_after_a_while(tmp_path: Path) -> None:
    now = [0.0]
    files = DriverFiles(tmp_path / "root", V, clock=lambda: now[0])
    with pytest.raises(DriverInstallationError):
        files.edits()
    make_root(tmp_path / "root")  # the driver container finished installing
    now[0] = 5.0
    with pytest.raises(DriverInstallationError):
        files.edits()  # not looked at again yet
    now[0] = 11.0
    assert any(m["containerPath"] == "/usr/local/nvidia/lib64/libcuda.so.1" for m in files.edits()["mounts"])


def test_same_library_in_two_directories_is_mounted_once(tmp_path: Path) -> None:
    root = make_root(tmp_path / "r")
    make_root(root, libdir="usr/lib64")
    found = discover_installation(root, V)
    assert [lib.path for lib in found.libraries if lib.name == "libcuda.so"] == [f"usr/lib64/libcuda.so.{V}"]
    targets = [m["containerPath"] for m in container_edits(found)["mounts"]]
    assert len(targets) == len(set(targets))
    assert os.path.basename(targets[0]).startswith("lib")


def test_a_missing_node_on_a_real_node_is_asked_of_nvidia_modprobe(tmp_path: Path) -> None:
    from dra_gpu.plugin.device_nodes import DeviceNodeError, DeviceNodes, find_modprobe

    # A stand-in nvidia-modprobe in the driver root that records how it was called (it creates
    # nothing, so the node stays missing and prepare's error names it).
    calls = tmp_path / "calls"
    tool = tmp_path / "root/usr/bin/nvidia-modprobe"
    tool.parent.mkdir(parents=True)
    tool.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    tool.chmod(0o755)
    modprobe = find_modprobe(tmp_path / "root")
    assert modprobe == str(tool)
    nodes = DeviceNodes(Path("/"), modprobe=modprobe)
    missing = [nodes.node("/dev/nvidia987")]
    with pytest.raises(DeviceNodeError, match=r"/dev/nvidia987 is missing .*nvidia-modprobe -c 987.*retried"):
        nodes.verify(missing)
    assert calls.read_text().split("\n")[0] == "-c 987"
    # A simulated dev root never runs it: the tool makes nodes in the real /dev only.
    assert DeviceNodes(tmp_path / "sim", modprobe=modprobe).modprobe is None


def test_nvidia_modprobe_is_found_through_links_inside_the_driver_root_only(tmp_path: Path) -> None:
    from dra_gpu.plugin.device_nodes import find_modprobe

    root = tmp_path / "root"
    real = root / "usr/lib/nvidia/nvidia-modprobe"
    real.parent.mkdir(parents=True)
    real.write_text("#!/bin/sh\n")
    real.chmod(0o755)
    (root / "usr/bin").mkdir(parents=True)
    # An absolute link, as a host's packages make it: it names the root's file, not ours.
    os.symlink("/usr/lib/nvidia/nvidia-modprobe", root / "usr/bin/nvidia-modprobe")
    assert find_modprobe(root) == str(real)
    # A link to a program only this process's filesystem has is never taken for the driver's.
    other = tmp_path / "other"
    (other / "usr/bin").mkdir(parents=True)
    os.symlink("/bin/sh", other / "usr/bin/nvidia-modprobe")
    found = find_modprobe(other)
    assert found is None or not found.startswith(str(other))
