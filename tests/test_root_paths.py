"""Paths inside a driver root: links are followed inside the root, never into this process's own
filesystem (a Debian host's alternatives links are absolute)."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import pytest

from dra_gpu.discovery.root_paths import RootPathError, regular_file_in_root, resolve_in_root

LIB = "usr/lib/x86_64-linux-gnu"


def _debian_root(root: Path) -> None:
    """Debian's layout of libnvidia-ml1 + the nvidia-alternative links, as dpkg leaves them."""
    current = root / LIB / "nvidia" / "current"
    current.mkdir(parents=True)
    (current / "libnvidia-ml.so.550.163.01").write_bytes(b"\x7fELF real")
    os.symlink("libnvidia-ml.so.550.163.01", current / "libnvidia-ml.so.1")
    (root / "etc" / "alternatives").mkdir(parents=True)
    os.symlink(
        f"/{LIB}/nvidia/current/libnvidia-ml.so.1",
        root / "etc" / "alternatives" / "nvidia--libnvidia-ml.so.1-x86_64-linux-gnu",
    )
    os.symlink(
        "/etc/alternatives/nvidia--libnvidia-ml.so.1-x86_64-linux-gnu", root / LIB / "libnvidia-ml.so.1"
    )


def test_debian_alternatives_links_resolve_inside_the_root(tmp_path: Path) -> None:
    _debian_root(tmp_path)
    found = resolve_in_root(tmp_path, f"{LIB}/libnvidia-ml.so.1")
    assert found == PurePosixPath(LIB, "nvidia", "current", "libnvidia-ml.so.550.163.01")
    path = regular_file_in_root(tmp_path, f"/{LIB}/libnvidia-ml.so.1")
    assert path is not None and path.read_bytes() == b"\x7fELF real"


def test_an_absolute_link_never_reaches_this_process_filesystem(tmp_path: Path) -> None:
    # /etc/hostname exists here, not in the root: the link must not find this machine's file.
    assert Path("/etc/hostname").exists() or Path("/etc/passwd").exists()
    target = "/etc/hostname" if Path("/etc/hostname").exists() else "/etc/passwd"
    (tmp_path / "usr" / "bin").mkdir(parents=True)
    os.symlink(target, tmp_path / "usr" / "bin" / "nvidia-smi")
    assert resolve_in_root(tmp_path, "usr/bin/nvidia-smi") is None
    assert regular_file_in_root(tmp_path, "usr/bin/nvidia-smi") is None


def test_dot_dot_stops_at_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "tool").write_text("inside")
    (tmp_path / "tool").write_text("outside")
    os.symlink("../../../../tool", root / "usr" / "bin" / "tool")
    found = regular_file_in_root(root, "usr/bin/tool")
    assert found is not None and found.read_text() == "inside"


def test_a_link_loop_is_an_error_and_no_file(tmp_path: Path) -> None:
    os.symlink("b", tmp_path / "a")
    os.symlink("/a", tmp_path / "b")
    with pytest.raises(RootPathError):
        resolve_in_root(tmp_path, "a")
    assert regular_file_in_root(tmp_path, "a") is None


def test_a_directory_or_missing_path_is_no_regular_file(tmp_path: Path) -> None:
    (tmp_path / "usr" / "lib").mkdir(parents=True)
    assert regular_file_in_root(tmp_path, "usr/lib") is None
    assert regular_file_in_root(tmp_path, "usr/lib/libcuda.so.1") is None
    assert resolve_in_root(tmp_path, "usr/lib/libcuda.so.1") is None
