"""A driver upgrade under a running plugin: which version the node's driver is now, and what the
plugin does about it.

How an upgrade looks on a node:
- Debian/Ubuntu packages (`apt upgrade`): dpkg replaces the user space in place under the same root
  (`libcuda.so.535.261.03` removed, `libcuda.so.550.163.01` written, the SONAME links moved); the
  loaded kernel module stays the old one until the node reboots or the modules are reloaded. In
  between, the new NVML refuses the old module (NVML_ERROR_LIB_RM_VERSION_MISMATCH) and a container
  given the new libraries cannot use its GPU either.
- GPU Operator: the driver container is replaced; the new one unloads the old module (every
  process holding /dev/nvidia* must be gone, this plugin's NVML included), loads its own and mounts
  its root at /run/nvidia/driver, which reaches the plugin's /driver-root through the chart's
  HostToContainer mount propagation: libraries and module change together.

Three versions tell the states apart, read at every prepare and every POLL_SECONDS (a few
readlinks and one small file, no NVML call): the version in the name of the file the driver root's
`libnvidia-ml.so.1` resolves to now, the loaded kernel module's (`proc/driver/nvidia/version`), and
the version of the NVML this process loaded at its start.
- CURRENT: all agree (or the module's version is unknown and the libraries are the loaded ones).
- MISMATCH: libraries and module disagree. New claims are refused, naming both versions, before
  anything is written (no CDI spec, no checkpoint entry); prepared claims keep their specs and
  running containers their mounts. The plugin keeps its old NVML: it still matches the module
  while the packages are upgraded on disk.
- UPGRADED: libraries and module agree on another version than the loaded NVML's. A loaded
  libnvidia-ml cannot be unloaded from a process, and the plugin's NVML (health events, MIG,
  compute modes) must be the module's, so the plugin stops cleanly, says both versions in one log
  line, and exits with EXIT_DRIVER_CHANGED; its DaemonSet's restart loads the new NVML and finds
  the new files, and the start-up reconcile rewrites every prepared claim's CDI spec with them.
  That rewrite is what a restarting container of an old claim needs: the specs name the driver's
  files by their versioned paths, and the old version's files are gone. Exiting rather than
  re-executing in place: every start already runs that path (NVML, discovery, reconcile) and is
  tested; a re-exec would have to undo the event loop, the gRPC threads and NVML's open device
  nodes first. The cost is one restart on the plugin's pod (the kubelet's first restart is at once).
- MISSING: no libnvidia-ml.so.1 under the driver root (a driver container between its unmount and
  its mount): new claims are refused until it is back.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dra_gpu.discovery.driver_versions import KERNEL_VERSION_FILE, kernel_module_version, library_version
from dra_gpu.discovery.nvml_discovery import NvmlUnavailableError
from dra_gpu.discovery.nvml_library import NVML_SONAME, find_nvml

log = logging.getLogger(__name__)

POLL_SECONDS = 2.0  # how often a serving plugin looks, besides at every prepare


class DriverState(enum.Enum):
    CURRENT = "current"
    MISMATCH = "mismatch"  # libraries and kernel module of two versions
    UPGRADED = "upgraded"  # both of another version than the NVML this process loaded
    MISSING = "missing"  # no libnvidia-ml.so.1 under the driver root


@dataclass(frozen=True)
class DriverVersions:
    loaded: str  # the NVML this process loaded (its file name's version)
    libraries: str | None  # the driver root's libnvidia-ml.so.1 now; None: not there
    module: str | None  # the loaded kernel module; None: no proc file (a simulated node without one)

    @property
    def state(self) -> DriverState:
        if self.libraries is None:
            return DriverState.MISSING
        if self.module is not None and self.module != self.libraries:
            return DriverState.MISMATCH
        if self.libraries != self.loaded:
            return DriverState.UPGRADED
        return DriverState.CURRENT


def library_file_version(driver_root: Path) -> str | None:
    """The version in the name of the file the driver root's libnvidia-ml.so.1 resolves to (links
    followed inside the root); None when there is none. A file without a version in its name
    counts as the loaded one's (nothing to compare)."""
    try:
        return library_version(find_nvml(driver_root)) or ""
    except (NvmlUnavailableError, OSError):
        return None


class DriverUpgradeError(RuntimeError):
    """The driver on disk is not the one this process serves (a prepare is refused)."""


class DriverVersionWatch:
    """Reads the node's driver versions against the loaded NVML's; `check` is a prepare's gate."""

    def __init__(
        self,
        driver_root: Path,
        dev_root: Path,
        loaded: str,
        host_root: str | None = None,
        on_upgraded: Callable[[DriverVersions], None] | None = None,
    ) -> None:
        self.driver_root = driver_root
        self.dev_root = dev_root
        self.loaded = loaded
        self.host_root = host_root or str(driver_root)
        self.on_upgraded = on_upgraded
        self._said: DriverState = DriverState.CURRENT

    def read(self) -> DriverVersions:
        libraries = library_file_version(self.driver_root)
        return DriverVersions(
            self.loaded,
            self.loaded if libraries == "" else libraries,
            kernel_module_version(self.dev_root),
        )

    def poll(self) -> DriverVersions:
        """Read the versions, log a change of state once, and report an upgrade."""
        versions = self.read()
        state = versions.state
        if state != self._said:
            self._said = state
            if state == DriverState.CURRENT:
                log.info("driver versions agree again version=%s", versions.libraries)
            elif state != DriverState.UPGRADED:  # the upgrade's line is the restart's
                log.warning("%s", self.problem(versions))
        if state == DriverState.UPGRADED and self.on_upgraded is not None:
            self.on_upgraded(versions)
        return versions

    def check(self) -> None:
        """Raise DriverUpgradeError unless the driver is the one this process loaded."""
        versions = self.poll()
        if versions.state != DriverState.CURRENT:
            raise DriverUpgradeError(self.problem(versions) + "; nothing was written")

    def problem(self, v: DriverVersions) -> str:
        state = v.state
        if state == DriverState.MISSING:
            return (
                f"the driver's {NVML_SONAME} is missing under {self.host_root} (a driver upgrade under "
                f"way?); this plugin serves driver {v.loaded}"
            )
        if state == DriverState.MISMATCH:
            return (
                f"driver version mismatch: the driver libraries under {self.host_root} are version "
                f"{v.libraries} but the loaded kernel module is version {v.module} "
                f"({self.dev_root / KERNEL_VERSION_FILE}): the driver was changed on disk and the "
                f"kernel module not reloaded; new claims are refused until they agree (reboot the "
                f"node, or reload the NVIDIA kernel modules)"
            )
        if state == DriverState.UPGRADED:
            return (
                f"driver changed from {v.loaded} to {v.libraries} (libraries and kernel module): "
                f"this plugin's NVML is {v.loaded}'s and cannot be unloaded; it restarts to serve "
                f"{v.libraries}"
            )
        return f"driver {v.loaded}"
