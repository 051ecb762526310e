"""A simulated node's device nodes never take a major the running kernel gives to a driver: such a
node would open that driver (NVIDIA's real GPUs at 195, /dev/mem at 1:1)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from simnode import devnodes
from simnode.devnodes import RealDriverMajorError, character_majors, make_char, make_device_nodes
from simnode.node import SimulatedNodeError, prepare_simulated_node

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root (CAP_MKNOD)")

WITH_NVIDIA = """Character devices:
  1 mem
  4 tty
 10 misc
195 nvidia-frontend
236 nvidia-caps
237 nvidia-uvm

Block devices:
  7 loop
259 blkext
"""
WITHOUT_NVIDIA = """Character devices:
  1 mem
 10 misc
 89 i2c

Block devices:
195 not-a-char-device
"""


def proc_devices(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "proc-devices"
    path.write_text(text)
    return path


def test_the_character_majors_are_read_from_their_section_only(tmp_path: Path) -> None:
    assert character_majors(proc_devices(tmp_path, WITH_NVIDIA)) == {
        1: "mem",
        4: "tty",
        10: "misc",
        195: "nvidia-frontend",
        236: "nvidia-caps",
        237: "nvidia-uvm",
    }
    assert 195 not in character_majors(proc_devices(tmp_path, WITHOUT_NVIDIA))  # a block major


@pytest.mark.parametrize(("major", "holder"), [(195, "nvidia-frontend"), (237, "nvidia-uvm"), (1, "mem")])
def test_a_major_a_driver_holds_is_refused_and_nothing_is_made(
    tmp_path: Path, major: int, holder: str
) -> None:
    proc = proc_devices(tmp_path, WITH_NVIDIA)
    with pytest.raises(
        RealDriverMajorError, match=rf"major {major} belongs to the kernel's '{holder}' driver"
    ):
        make_char(tmp_path / "dev" / "node", major, 0, proc)
    assert not (tmp_path / "dev").exists()


def test_the_nvidia_nodes_are_refused_where_nvidias_module_is_loaded(tmp_path: Path) -> None:
    with pytest.raises(RealDriverMajorError, match=r"nvidiactl \(195:255\): major 195"):
        make_device_nodes(tmp_path / "dev", [0, 1], proc_devices(tmp_path, WITH_NVIDIA))
    assert list((tmp_path / "dev").iterdir()) == []


@needs_root
def test_a_major_no_driver_holds_is_made(tmp_path: Path) -> None:
    dev = make_device_nodes(tmp_path / "dev", [0, 3], proc_devices(tmp_path, WITHOUT_NVIDIA))
    st = os.stat(dev / "nvidia3")
    assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (195, 3)


def test_a_simulated_node_on_a_host_with_nvidias_module_does_not_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devnodes, "PROC_DEVICES", proc_devices(tmp_path, WITH_NVIDIA))
    with pytest.raises(
        SimulatedNodeError, match=r"simulated node hgx-2x4: refusing to make .* 'nvidia-frontend'"
    ):
        prepare_simulated_node("hgx-2x4", tmp_path / "root", driver_root=tmp_path / "driver")
    assert not any(p.is_char_device() for p in (tmp_path / "root").rglob("*"))
