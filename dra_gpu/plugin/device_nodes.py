"""The character devices a container needs for a GPU or MIG device, and their simulation.

On a real node `dev_root` is "/" and the NVIDIA driver made the nodes. On a simulated node the
plugin makes real character devices with mknod under `<dev_root>/dev` (and the MIG capability
files the driver would expose under `<dev_root>/proc`), so the runtime injects something real.

A spec never lacks a node its device needs: every prepare checks the host nodes. A node missing
on a real node (e.g. `/dev/nvidia-uvm` before the first CUDA program loaded the uvm module) is
created the way the driver's own tools do, with `nvidia-modprobe` where it is installed; if it is
still missing, prepare fails with an error naming the node, and the kubelet retries.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

from dra_gpu.model import Gpu, Inventory, MigDevice
from dra_gpu.plugin.cdi import DeviceNode

log = logging.getLogger(__name__)

NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255
# The uvm and caps majors are assigned dynamically by the kernel; these are for simulation only.
SIM_UVM_MAJOR = 509
SIM_CAPS_MAJOR = 508
NVIDIA_MODESET_MINOR = 254
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
OPTIONAL_CONTROL_NODES = ("/dev/nvidia-modeset",)  # only with the nvidia-modeset module loaded
MODPROBE_TIMEOUT = 10.0

_MINOR_LINE = re.compile(r"DeviceFileMinor:\s*(\d+)")


class DeviceNodeError(RuntimeError):
    pass


class DeviceNodes:
    """Maps devices to their nodes under a dev root and checks that the host nodes exist."""

    def __init__(self, dev_root: Path, modprobe: str | None = None) -> None:
        self.root = dev_root
        # nvidia-modprobe makes nodes in the real /dev only, so only a plugin that sees it uses it.
        self.modprobe = modprobe if str(dev_root) == "/" else None
        # Paths as strings, joined once: every prepare maps its devices again.
        self._root = str(dev_root)
        self._caps = os.path.join(self._root, "proc/driver/nvidia/capabilities")
        self._hosts: dict[str, str] = {}
        self._minors: dict[str, tuple[tuple[int, int, int], str]] = {}  # access file -> (its stat, minor)

    def host(self, container_path: str) -> str:
        host = self._hosts.get(container_path)
        if host is None:
            host = self._hosts[container_path] = os.path.join(self._root, container_path.lstrip("/"))
        return host

    def node(self, container_path: str) -> DeviceNode:
        return DeviceNode(path=container_path, host_path=self.host(container_path))

    def control(self) -> list[DeviceNode]:
        nodes = [self.node(p) for p in CONTROL_NODES]
        return nodes + [n for p in OPTIONAL_CONTROL_NODES if _is_char((n := self.node(p)).host_path)]

    def gpu(self, gpu: Gpu) -> list[DeviceNode]:
        return [self.node(f"/dev/nvidia{gpu.minor}")]

    def mig(self, gpu: Gpu, mig: MigDevice) -> list[DeviceNode]:
        """The parent's node plus the GI and CI capability nodes the driver lists in /proc."""
        gi = f"{self._caps}/gpu{gpu.minor}/mig/gi{mig.gpu_instance_id}"
        nodes = self.gpu(gpu)
        for access in (f"{gi}/access", f"{gi}/ci{mig.compute_instance_id}/access"):
            nodes.append(self.node(f"/dev/nvidia-caps/nvidia-cap{self._cap_minor(mig, access)}"))
        return nodes

    def _cap_minor(self, mig: MigDevice, access: str) -> str:
        """The capability node's minor from its access file. The driver fixes it per GPU, GI and
        CI, so it is read once per file; the file is still looked at every time (a stat): it is
        there exactly while the instance is."""
        try:
            st = os.stat(access)
            identity = (st.st_ino, st.st_mtime_ns, st.st_size)
            known = self._minors.get(access)
            if known is not None and known[0] == identity:
                return known[1]
            with open(access, encoding="utf-8") as f:
                match = _MINOR_LINE.search(f.read())
        except OSError as exc:
            raise DeviceNodeError(f"MIG device {mig.uuid}: cannot read {access}: {exc}") from exc
        if not match:
            raise DeviceNodeError(f"MIG device {mig.uuid}: no DeviceFileMinor in {access}")
        self._minors[access] = (identity, match.group(1))
        return match.group(1)

    def verify(self, nodes: list[DeviceNode]) -> None:
        """Fail unless every host node is a character device (never hand out an empty spec)."""
        missing = [n for n in nodes if not _is_char(n.host_path)]
        if missing and self.modprobe is not None:
            for n in missing:
                self._create(n.path)
            missing = [n for n in missing if not _is_char(n.host_path)]
        for n in missing:
            try:
                os.stat(n.host_path)
            except OSError as exc:
                raise DeviceNodeError(
                    f"device node {n.host_path} is missing ({exc.strerror}); the NVIDIA driver has not "
                    f"created it{_how(n.path)}; prepare will be retried"
                ) from exc
            raise DeviceNodeError(f"device node {n.host_path} is not a character device")

    def _create(self, path: str) -> None:
        """Ask nvidia-modprobe for the node at `path` (bounded; failures are left to verify)."""
        args = _modprobe_args(path)
        if args is None or self.modprobe is None:
            return
        try:
            subprocess.run([self.modprobe, *args], capture_output=True, timeout=MODPROBE_TIMEOUT, check=False)
            log.info("nvidia-modprobe ran node=%s args=%s", path, " ".join(args))
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("nvidia-modprobe failed node=%s error=%s", path, exc)


def find_modprobe(driver_root: Path) -> str | None:
    """nvidia-modprobe of the driver installation, else on PATH."""
    for rel in ("usr/bin", "usr/sbin", "bin", "sbin"):
        candidate = driver_root / rel / "nvidia-modprobe"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("nvidia-modprobe")


def _is_char(path: str) -> bool:
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False


def _modprobe_args(path: str) -> list[str] | None:
    """nvidia-modprobe's options that create the node at `path` (see its man page)."""
    name = path.rsplit("/", 1)[-1]
    if name in ("nvidia-uvm", "nvidia-uvm-tools"):
        return ["-u", "-c", "0"]
    if name == "nvidia-modeset":
        return ["-m"]
    if name.startswith("nvidia") and name[len("nvidia") :].isdigit():
        return ["-c", name[len("nvidia") :]]
    return None


def _how(path: str) -> str:
    args = _modprobe_args(path)
    return f" (nvidia-modprobe {' '.join(args)} would)" if args else ""


def _mknod(path: Path, major: int, minor: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    want = os.makedev(major, minor)
    try:
        st = os.stat(path)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == want:
            return
        path.unlink()
    except FileNotFoundError:
        pass
    os.mknod(path, 0o666 | stat.S_IFCHR, want)


def create_simulated(inventory: Inventory, dev_root: Path) -> int:
    """Make the nodes (and MIG capability files) of a simulated node; returns how many nodes."""
    dev = dev_root / "dev"
    count = 0
    _mknod(dev / "nvidiactl", NVIDIA_MAJOR, NVIDIACTL_MINOR)
    _mknod(dev / "nvidia-uvm", SIM_UVM_MAJOR, 0)
    _mknod(dev / "nvidia-uvm-tools", SIM_UVM_MAJOR, 1)
    _mknod(dev / "nvidia-modeset", NVIDIA_MAJOR, NVIDIA_MODESET_MINOR)
    count += 4
    cap_minor = 1
    for gpu in sorted(inventory.gpus, key=lambda g: g.minor):
        _mknod(dev / f"nvidia{gpu.minor}", NVIDIA_MAJOR, gpu.minor)
        count += 1
        # Dynamic MIG instances get theirs from the simulated driver when it makes them.
        for mig in [] if gpu.dynamic_mig else gpu.mig_devices:
            base = dev_root / "proc/driver/nvidia/capabilities" / f"gpu{gpu.minor}" / "mig"
            for access in (
                base / f"gi{mig.gpu_instance_id}" / "access",
                base / f"gi{mig.gpu_instance_id}" / f"ci{mig.compute_instance_id}" / "access",
            ):
                access.parent.mkdir(parents=True, exist_ok=True)
                access.write_text(f"DeviceFileMinor: {cap_minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
                _mknod(dev / "nvidia-caps" / f"nvidia-cap{cap_minor}", SIM_CAPS_MAJOR, cap_minor)
                cap_minor += 1
                count += 1
    log.info("simulated device nodes ready dev_root=%s nodes=%d", dev_root, count)
    return count
