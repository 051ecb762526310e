"""Driver-root layouts real nodes have, and what a container gets from each (the CDI mounts).

- Debian's packages (bookworm 535.261.03, trixie 550.163.01): NVIDIA's real files, installed by
  dpkg with Debian's alternatives (tests/driver_root.py `debian_root`: e2e/node/debian_driver_root.py's
  cached roots). Libraries in `usr/lib/x86_64-linux-gnu/nvidia/current/`, `nvidia-smi` in
  `usr/lib/nvidia/current/`, both reached through absolute links via `/etc/alternatives`.
- Ubuntu's packages and NVIDIA's `.run` installer (libraries in `usr/lib/x86_64-linux-gnu/` or
  `usr/lib64/`, binaries in `usr/bin/`), with a merged /usr and `var/run -> /run`: built here.
- Links that lead out of the driver root, or to files only this process's filesystem has, are
  never followed.

A mount's host path is the file itself, every link resolved inside the driver root, under the
root as the runtime sees it (`host_root`); its container path is where the root's own system has
it (the path it was found through).
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from typing import Any

import pytest

from dra_gpu.discovery.driver_install import DriverInstallation, discover_installation, read_soname
from dra_gpu.plugin.driver_files import CUDA_STYLE_BIN_DIR, CUDA_STYLE_LIB_DIR, container_edits
from tests.driver_root import DEB, debian_driver_roots, debian_root, make_root, with_simulated_nvml
from tests.simnode_support import needs_root, nvml_h  # noqa: F401 - a fixture

V = "570.133.20"
HOST = "/run/nvidia/driver"  # the driver root as the runtime sees it (the plugin sees it elsewhere)
CURRENT = f"{DEB}/nvidia/current"
DEBIAN = [(s.name, s.driver_version) for s in debian_driver_roots().SUITES.values()]

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


def mounts(found: DriverInstallation) -> dict[str, str]:
    """containerPath -> hostPath of the CDI mounts made from `found`."""
    edits: dict[str, Any] = container_edits(found)
    by_target = {m["containerPath"]: m["hostPath"] for m in edits["mounts"]}
    assert len(by_target) == len(edits["mounts"]), "two mounts at one container path"
    return by_target


def assert_host_paths_are_files_in_the_root(found: DriverInstallation, root: Path) -> None:
    """Every host path is under the runtime's root and names the file itself (no link left on the
    way), which is the file this process sees under `root`."""
    for host_path in mounts(found).values():
        assert host_path.startswith(found.root + "/"), host_path
        local = root / host_path[len(found.root) + 1 :]
        assert os.path.realpath(local) == str(local), f"{host_path}: a link is left in the path"
        assert local.is_file() or local.is_socket(), host_path


# ---------------------------------------------------------------- Debian's real packages


@pytest.mark.parametrize(("suite", "version"), DEBIAN, ids=[s for s, _ in DEBIAN])
def test_debian_packages_give_a_container_every_file(suite: str, version: str) -> None:
    root = debian_root(suite)
    found = discover_installation(root, version, host_root=HOST)
    assert found.error is None
    assert found.other_versions == []
    assert {lib.name for lib in found.libraries} == {
        "libcuda.so",
        "libnvidia-ml.so",
        "libnvidia-ptxjitcompiler.so",
        "libnvidia-cfg.so",
        "libnvidia-pkcs11-openssl3.so",  # in the multiarch directory itself, not nvidia/current
    }
    by_target = mounts(found)
    current = f"{HOST}/{CURRENT}"
    # The loader's default path of a Debian/Ubuntu image finds the SONAMEs where the host has them
    # (Debian's alternatives links), mounted from the real files in nvidia/current.
    for soname, name in (
        ("libcuda.so.1", "libcuda.so"),
        ("libnvidia-ml.so.1", "libnvidia-ml.so"),
        ("libnvidia-ptxjitcompiler.so.1", "libnvidia-ptxjitcompiler.so"),
    ):
        real = f"{current}/{name}.{version}"
        assert by_target[f"/{DEB}/{soname}"] == real
        assert by_target[f"/{CURRENT}/{soname}"] == real
        assert by_target[f"/{CURRENT}/{name}.{version}"] == real
        assert by_target[f"{CUDA_STYLE_LIB_DIR}/{soname}"] == real
        assert read_soname(root / CURRENT / f"{name}.{version}") == soname
    assert by_target[f"/{DEB}/libcuda.so"] == f"{current}/libcuda.so.{version}"
    # nvidia-smi behind /usr/bin/nvidia-smi -> /etc/alternatives/nvidia--nvidia-smi -> ...
    smi = f"{HOST}/usr/lib/nvidia/current/nvidia-smi"
    assert os.readlink(root / "usr/bin/nvidia-smi") == "/etc/alternatives/nvidia--nvidia-smi"
    assert by_target["/usr/bin/nvidia-smi"] == smi
    assert by_target[f"{CUDA_STYLE_BIN_DIR}/nvidia-smi"] == smi
    assert by_target["/usr/bin/nvidia-cuda-mps-control"] == f"{HOST}/usr/bin/nvidia-cuda-mps-control"
    assert by_target["/usr/sbin/nvidia-cuda-mps-server"] == f"{HOST}/usr/sbin/nvidia-cuda-mps-server"
    assert by_target["/usr/bin/nvidia-persistenced"] == f"{HOST}/usr/bin/nvidia-persistenced"
    # GSP firmware: /lib/firmware is usr/lib/firmware behind the merged-/usr `lib` link.
    for fw in ("gsp_ga10x.bin", "gsp_tu10x.bin"):
        assert (
            by_target[f"/lib/firmware/nvidia/{version}/{fw}"]
            == f"{HOST}/usr/lib/firmware/nvidia/{version}/{fw}"
        )
    assert len(found.binaries) == 4 and len(found.firmware) == 2 and found.ipc_sockets == []
    assert found.missing_optional[-1:] == ["nvidia-debugdump"]
    # What this process runs (sharing: nvidia-smi, the MPS control daemon) is the file itself.
    assert "usr/lib/nvidia/current/nvidia-smi" in found.binaries
    # Seen where it is: host root = the root this process reads.
    local = discover_installation(root, version)
    assert_host_paths_are_files_in_the_root(local, root)
    assert mounts(local)["/usr/bin/nvidia-smi"] == f"{root}/usr/lib/nvidia/current/nvidia-smi"


@pytest.mark.parametrize(("suite", "version"), DEBIAN, ids=[s for s, _ in DEBIAN])
def test_inventory_lists_the_debian_files(suite: str, version: str) -> None:
    from dra_gpu.discovery.driver_install import describe

    found = discover_installation(debian_root(suite), version)
    lines = list(describe(found, str(found.root)))
    assert "5 libraries, 4 binaries, 2 firmware files, 0 IPC sockets" in lines[0]
    assert any("/usr/bin/nvidia-smi (-> /usr/lib/nvidia/current/nvidia-smi)" in line for line in lines)
    files = {f["path"]: f["file"] for f in found.summary()["files"]}
    assert files["/usr/bin/nvidia-smi"] == "/usr/lib/nvidia/current/nvidia-smi"


# ---------------------------------------------------------------- layouts built here


def _merged_usr(root: Path) -> None:
    for name in ("bin", "sbin", "lib", "lib64"):
        (root / "usr" / name).mkdir(parents=True, exist_ok=True)
        (root / name).symlink_to(f"usr/{name}")
    (root / "run").mkdir()
    (root / "var").mkdir()
    (root / "var/run").symlink_to("/run")  # absolute, as Debian and Ubuntu have it


def _persistenced_socket(root: Path) -> socket.socket:
    (root / "run/nvidia-persistenced").mkdir(parents=True)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(root / "run/nvidia-persistenced/socket"))
    return sock


@needs_cc
@pytest.mark.parametrize("libdir", [DEB, "usr/lib64"], ids=["ubuntu", "run-installer"])
def test_ubuntu_and_run_installer_layouts(tmp_path: Path, libdir: str) -> None:
    root = tmp_path / "root"
    _merged_usr(root)
    make_root(root, V, libdir=libdir)
    # The installer's firmware with R615's ucode files next to GSP's; nothing else is firmware.
    fw = root / "usr/lib/firmware/nvidia" / V
    for name in ("ucodes_ga10x.bin", "ucode_tu10x.bin", "README.txt"):
        (fw / name).write_bytes(b"\0")
    (root / "usr/bin/nvidia-cuda-mps-server").write_bytes(
        (root / "usr/bin/nvidia-cuda-mps-control").read_bytes()
    )
    (root / "usr/bin/nvidia-cuda-mps-server").chmod(0o755)
    with _persistenced_socket(root):
        found = discover_installation(root, V, host_root=HOST)
    assert found.error is None
    by_target = mounts(found)
    for soname, name in (("libcuda.so.1", "libcuda.so"), ("libnvidia-ml.so.1", "libnvidia-ml.so")):
        real = f"{HOST}/{libdir}/{name}.{V}"
        assert by_target[f"/{libdir}/{soname}"] == real
        assert by_target[f"/{libdir}/{name}.{V}"] == real
        assert by_target[f"{CUDA_STYLE_LIB_DIR}/{soname}"] == real
    assert (
        by_target[f"/{libdir}/libnvidia-ptxjitcompiler.so.1"]
        == f"{HOST}/{libdir}/libnvidia-ptxjitcompiler.so.{V}"
    )
    for binary in ("nvidia-smi", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server"):
        assert by_target[f"/usr/bin/{binary}"] == f"{HOST}/usr/bin/{binary}"
    assert sorted(os.path.basename(f) for f in found.firmware) == [
        "gsp_ga10x.bin",
        "ucode_tu10x.bin",
        "ucodes_ga10x.bin",
    ]
    for name in ("gsp_ga10x.bin", "ucodes_ga10x.bin", "ucode_tu10x.bin"):
        assert by_target[f"/lib/firmware/nvidia/{V}/{name}"] == f"{HOST}/usr/lib/firmware/nvidia/{V}/{name}"
    # The persistence daemon's socket through the absolute var/run -> /run link, found inside the root.
    assert found.ipc_sockets == ["run/nvidia-persistenced/socket"]
    assert by_target["/run/nvidia-persistenced/socket"] == f"{HOST}/run/nvidia-persistenced/socket"


@needs_cc
def test_debian_alternatives_layout_built_here(tmp_path: Path) -> None:
    """Debian's layout without Debian's archive: the same links as dpkg leaves them."""
    root = tmp_path / "root"
    make_root(root, V, libdir=CURRENT)
    alternatives = root / "etc/alternatives"
    alternatives.mkdir(parents=True)
    for soname in ("libcuda.so.1", "libnvidia-ml.so.1"):
        alt = alternatives / f"nvidia--{soname}-x86_64-linux-gnu"
        alt.symlink_to(f"/{CURRENT}/{soname}")
        (root / DEB / soname).symlink_to(f"/etc/alternatives/{alt.name}")
    smi = root / "usr/lib/nvidia/current/nvidia-smi"
    smi.parent.mkdir(parents=True)
    (root / "usr/bin/nvidia-smi").rename(smi)
    (alternatives / "nvidia--nvidia-smi").symlink_to("/usr/lib/nvidia/current/nvidia-smi")
    (root / "usr/bin/nvidia-smi").symlink_to("/etc/alternatives/nvidia--nvidia-smi")
    found = discover_installation(root, V)
    by_target = mounts(found)
    assert by_target[f"/{DEB}/libcuda.so.1"] == f"{root}/{CURRENT}/libcuda.so.{V}"
    assert by_target[f"/{DEB}/libnvidia-ml.so.1"] == f"{root}/{CURRENT}/libnvidia-ml.so.{V}"
    assert by_target["/usr/bin/nvidia-smi"] == f"{root}/usr/lib/nvidia/current/nvidia-smi"
    assert_host_paths_are_files_in_the_root(found, root)


# ---------------------------------------------------------------- links that leave the root


@needs_cc
def test_links_out_of_the_root_are_never_followed(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root", V)
    # Real files outside the root, which this process could read: a driver library of the right
    # version, a firmware directory, an executable.
    outside = make_root(tmp_path / "outside", V)
    lib = root / DEB / f"libnvidia-opencl.so.{V}"
    lib.symlink_to(outside / DEB / f"libcuda.so.{V}")  # absolute: means <root>/<that path>
    (root / DEB / f"libnvidia-cfg.so.{V}").symlink_to(
        f"../../../../../../../../..{outside}/{DEB}/libcuda.so.{V}"
    )
    shutil.rmtree(root / "lib/firmware/nvidia" / V)
    (root / "lib/firmware/nvidia" / V).symlink_to(outside / "lib/firmware/nvidia" / V)
    # nvidia-smi as Debian links it, in a root whose /etc/alternatives is missing: the link must
    # not reach a file of this process's own filesystem (/bin/sh exists here, not in the root).
    (root / "usr/bin/nvidia-smi").unlink()
    (root / "usr/bin/nvidia-smi").symlink_to("/bin/sh")
    assert os.path.exists(root / "usr/bin/nvidia-smi")  # what os.stat / realpath would have taken
    # The MPS control daemon behind a link to this process's /usr/bin/env.
    (root / "usr/bin/nvidia-cuda-mps-control").unlink()
    (root / "usr/bin/nvidia-cuda-mps-control").symlink_to("/usr/bin/env")
    found = discover_installation(root, V)
    assert found.error is None
    names = {lib.name for lib in found.libraries}
    assert "libnvidia-opencl.so" not in names and "libnvidia-cfg.so" not in names
    assert found.binaries == []
    assert "nvidia-smi" in found.missing_optional and "nvidia-cuda-mps-control" in found.missing_optional
    assert found.firmware == []
    for host_path in mounts(found).values():
        assert host_path.startswith(f"{root}/") and str(outside) not in host_path
    assert_host_paths_are_files_in_the_root(found, root)


@needs_cc
def test_a_link_loop_is_no_file(tmp_path: Path) -> None:
    root = make_root(tmp_path / "root", V)
    (root / "usr/bin/nvidia-smi").unlink()
    (root / "usr/bin/nvidia-smi").symlink_to("/usr/bin/nvidia-smi-loop")
    (root / "usr/bin/nvidia-smi-loop").symlink_to("nvidia-smi")
    found = discover_installation(root, V)
    assert found.error is None and "nvidia-smi" in found.missing_optional


@needs_cc
@needs_root
@pytest.mark.usefixtures("nvml_h")
@pytest.mark.parametrize(("suite", "version"), DEBIAN, ids=[s for s, _ in DEBIAN])
def test_dra_gpu_inventory_on_the_debian_root(suite: str, version: str, tmp_path: Path) -> None:
    """`dra-gpu inventory --driver-root` on Debian's files, for a node whose NVML reports their
    version (a simulated node of that driver version: the root's NVML is the simulated library of
    that version, as on the e2e's real-node mode; NVIDIA's real one is never initialised here)."""
    import json
    import subprocess
    import sys

    import simnode.profiles as profiles_pkg
    import yaml

    root = debian_root(suite)
    doc = yaml.safe_load((Path(profiles_pkg.__file__).parent / "profiles" / "hgx-2x4.yaml").read_text())
    doc["driverVersion"] = version
    profile = tmp_path / "node.yaml"
    profile.write_text(yaml.safe_dump(doc))
    root = with_simulated_nvml(root, tmp_path / "root", profile, tmp_path / "cache")
    base = [
        sys.executable,
        "-m",
        "dra_gpu.cli",
        "inventory",
        "--profile",
        str(profile),
        "--driver-root",
        str(root),
    ]
    table = subprocess.run(base, capture_output=True, text=True, timeout=60, check=False)
    assert table.returncode == 0, table.stderr
    assert f"version {version}, 5 libraries, 4 binaries, 2 firmware files, 0 IPC sockets" in table.stdout
    assert "/usr/bin/nvidia-smi (-> /usr/lib/nvidia/current/nvidia-smi)" in table.stdout
    out = subprocess.run([*base, "-o", "json"], capture_output=True, text=True, timeout=60, check=False)
    inst = json.loads(out.stdout)["driverInstallation"]
    assert inst["error"] is None and inst["libraries"] == 5 and inst["binaries"] == 4
    assert {"path": "/usr/bin/nvidia-smi", "file": "/usr/lib/nvidia/current/nvidia-smi"} in inst["files"]


@needs_cc
def test_gke_layout_under_usr_local_nvidia(tmp_path: Path) -> None:
    """GKE's driver installer (and machines whose driver is mounted as CUDA-style images expect
    it) keep the driver in /usr/local/nvidia/{lib64,bin}."""
    root = tmp_path / "root"
    make_root(root, V, libdir="usr/local/nvidia/lib64")
    bindir = root / "usr/local/nvidia/bin"
    bindir.mkdir(parents=True)
    for binary in ("nvidia-smi", "nvidia-cuda-mps-control"):
        (root / "usr/bin" / binary).rename(bindir / binary)
    found = discover_installation(root, V, host_root=HOST)
    assert found.error is None
    by_target = mounts(found)
    real = f"{HOST}/usr/local/nvidia/lib64/libcuda.so.{V}"
    assert by_target[f"{CUDA_STYLE_LIB_DIR}/libcuda.so.1"] == real
    assert by_target["/usr/local/nvidia/bin/nvidia-smi"] == f"{HOST}/usr/local/nvidia/bin/nvidia-smi"
