"""The character devices a container needs for a GPU or MIG device.

On a real node `dev_root` is "/" and the NVIDIA driver made the nodes. On a simulated node the
simulator made real character devices with mknod under `<dev_root>/dev`, and its NVML keeps the
MIG capability files the driver would expose under `<dev_root>/proc` (`simnode.node`),
so the runtime injects something real.

Nodes whose numbers the kernel publishes go into the spec as numbers (`type: c`, `major`,
`minor`), so the runtime makes them in the container and no host node is needed: the MIG
capability nodes `/dev/nvidia-caps/nvidia-cap<N>` (major: `nvidia-caps` in `/proc/devices`;
minor and file mode: the capability's `access` file), which NVML never creates on the host, and
`/dev/nvidia-uvm` and `-uvm-tools` (major: `nvidia-uvm`; minors 0 and 1), which exist on the host
only once something ran `nvidia-modprobe -u`. The kernel lists a major exactly while its module is
loaded; `nvidia-uvm` not listed means the module is not loaded, which a container cannot change:
prepare fails naming the host-side fix.

The other nodes (`/dev/nvidia<N>`, `/dev/nvidiactl`) are the host's own: every prepare checks
them. A missing GPU node on a real node is created the way the driver's own tools do, with
`nvidia-modprobe -c <N>` where it is installed; if it is still missing, prepare fails with an
error naming the node, and the kubelet retries.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dra_gpu.discovery.driver_install import BINARY_DIRS
from dra_gpu.discovery.kernel_devices import CAPS, UVM, UVM_HOST_FIX, UVM_MINORS, char_majors, uvm_missing
from dra_gpu.discovery.root_paths import regular_file_in_root
from dra_gpu.model.inventory import Gpu, MigDevice
from dra_gpu.plugin.cdi import DeviceNode

log = logging.getLogger(__name__)

NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
OPTIONAL_CONTROL_NODES = ("/dev/nvidia-modeset",)  # only with the nvidia-modeset module loaded
MODPROBE_TIMEOUT = 10.0

_MINOR_LINE = re.compile(r"DeviceFileMinor:\s*(\d+)")
_MODE_LINE = re.compile(r"DeviceFileMode:\s*(\d+)")
CAP_FILE_MODE = 0o444  # what the driver's access files say (DeviceFileMode: 292)
NODE_PERMISSIONS = "rw"  # the container's device-cgroup access: read and write, never mknod


class DeviceNodeError(RuntimeError):
    pass


@dataclass(frozen=True)
class NumberedNode(DeviceNode):
    """A character device given to the container by its numbers: the runtime makes it there, no
    host node is read (CDI deviceNode `type`/`major`/`minor`, valid from cdiVersion 0.3.0)."""

    major: int = 0
    minor: int = 0
    file_mode: int | None = None

    def to_cdi(self) -> dict[str, Any]:
        node: dict[str, Any] = {
            "path": self.path,
            "type": "c",
            "major": self.major,
            "minor": self.minor,
            "permissions": NODE_PERMISSIONS,
        }
        if self.file_mode is not None:
            node["fileMode"] = self.file_mode
        return node


class DeviceNodes:
    """Maps devices to their nodes under a dev root and checks that the host nodes exist."""

    def __init__(self, dev_root: Path, modprobe: str | None = None, proc_devices: Path | None = None) -> None:
        self.root = dev_root
        # nvidia-modprobe makes nodes in the real /dev only, so only a plugin that sees it uses it.
        self.modprobe = modprobe if str(dev_root) == "/" else None
        # The kernel's device list (/proc/devices; a simulated node's under its dev root).
        self.proc_devices = proc_devices or dev_root / "proc/devices"
        # Paths as strings, joined once: every prepare maps its devices again.
        self._root = str(dev_root)
        self._caps = os.path.join(self._root, "proc/driver/nvidia/capabilities")
        self._hosts: dict[str, str] = {}
        # access file -> (its stat, minor, file mode)
        self._minors: dict[str, tuple[tuple[int, int, int], int, int]] = {}

    def host(self, container_path: str) -> str:
        host = self._hosts.get(container_path)
        if host is None:
            host = self._hosts[container_path] = os.path.join(self._root, container_path.lstrip("/"))
        return host

    def node(self, container_path: str) -> DeviceNode:
        return DeviceNode(path=container_path, host_path=self.host(container_path))

    def control(self) -> list[DeviceNode]:
        """nvidiactl (the host's), the uvm nodes by number while the kernel lists nvidia-uvm (else
        the host's paths, which `verify` then reports with the host-side fix), nvidia-modeset
        where the host has it."""
        uvm = char_majors(self.proc_devices).get(UVM)
        nodes: list[DeviceNode] = []
        for path in CONTROL_NODES:
            if path in UVM_MINORS and uvm is not None:
                nodes.append(NumberedNode(path, self.host(path), major=uvm, minor=UVM_MINORS[path]))
            else:
                nodes.append(self.node(path))
        return nodes + [n for p in OPTIONAL_CONTROL_NODES if _is_char((n := self.node(p)).host_path)]

    def gpu(self, gpu: Gpu) -> list[DeviceNode]:
        return [self.node(f"/dev/nvidia{gpu.minor}")]

    def mig(self, gpu: Gpu, mig: MigDevice) -> list[DeviceNode]:
        """The parent's node plus the GI and CI capability nodes the driver lists in /proc, by
        number (NVML makes no /dev/nvidia-caps nodes on the host)."""
        major = char_majors(self.proc_devices).get(CAPS)
        if major is None:
            raise DeviceNodeError(
                f"MIG device {mig.uuid}: the kernel lists no {CAPS} character device in "
                f"{self.proc_devices} (the NVIDIA driver's MIG capability support is not loaded)"
            )
        gi = f"{self._caps}/gpu{gpu.minor}/mig/gi{mig.gpu_instance_id}"
        nodes = self.gpu(gpu)
        for access in (f"{gi}/access", f"{gi}/ci{mig.compute_instance_id}/access"):
            minor, mode = self._cap_minor(mig, access)
            path = f"/dev/nvidia-caps/nvidia-cap{minor}"
            nodes.append(NumberedNode(path, self.host(path), major=major, minor=minor, file_mode=mode))
        return nodes

    def _cap_minor(self, mig: MigDevice, access: str) -> tuple[int, int]:
        """The capability node's minor and file mode from its access file. The driver fixes them
        per GPU, GI and CI, so it is read once per file; the file is still looked at every time
        (a stat): it is there exactly while the instance is."""
        try:
            st = os.stat(access)
            identity = (st.st_ino, st.st_mtime_ns, st.st_size)
            known = self._minors.get(access)
            if known is not None and known[0] == identity:
                return known[1], known[2]
            with open(access, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise DeviceNodeError(f"MIG device {mig.uuid}: cannot read {access}: {exc}") from exc
        match = _MINOR_LINE.search(text)
        if not match:
            raise DeviceNodeError(f"MIG device {mig.uuid}: no DeviceFileMinor in {access}")
        mode = _MODE_LINE.search(text)
        minor, file_mode = int(match.group(1)), int(mode.group(1)) & 0o777 if mode else CAP_FILE_MODE
        self._minors[access] = (identity, minor, file_mode)
        return minor, file_mode

    def verify(self, nodes: list[DeviceNode]) -> None:
        """Fail unless every host node is a character device (never hand out an empty spec);
        nodes given by number need none."""
        missing = [n for n in nodes if not isinstance(n, NumberedNode) and not _is_char(n.host_path)]
        if missing and self.modprobe is not None:
            for n in missing:
                self._create(n.path)
            missing = [n for n in missing if not _is_char(n.host_path)]
        for n in missing:
            try:
                os.stat(n.host_path)
            except OSError as exc:
                if n.path in UVM_MINORS and (why := uvm_missing(self.proc_devices)):
                    raise DeviceNodeError(
                        f"device node {n.host_path} is missing and {why}; {UVM_HOST_FIX}; "
                        f"prepare will be retried"
                    ) from exc
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
    """nvidia-modprobe of the driver installation (its links followed inside the driver root,
    never into this process's filesystem), else on PATH."""
    for rel in BINARY_DIRS:
        found = regular_file_in_root(driver_root, f"{rel}/nvidia-modprobe")
        if found is not None and os.access(found, os.X_OK):
            return str(found)
    return shutil.which("nvidia-modprobe")


def _is_char(path: str) -> bool:
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False


def _modprobe_args(path: str) -> list[str] | None:
    """nvidia-modprobe's options that create the node at `path` (see its man page)."""
    name = path.rsplit("/", 1)[-1]
    # Not the uvm nodes: `-u` loads the module, which needs the host's modprobe and /lib/modules;
    # with the module loaded the spec carries the nodes by number.
    if name == "nvidia-modeset":
        return ["-m"]
    if name.startswith("nvidia") and name[len("nvidia") :].isdigit():
        return ["-c", name[len("nvidia") :]]
    return None


def _how(path: str) -> str:
    args = _modprobe_args(path)
    return f" (nvidia-modprobe {' '.join(args)} would)" if args else ""
