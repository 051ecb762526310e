"""The node's GPU backend, opened once by a node command's composition root (the kubelet plugin,
`inventory`, `doctor`, the NVML probe) and handed to discovery, MIG instances, compute modes and
sharing, and health's event monitor.

NVML is the driver root's `libnvidia-ml.so.1`, loaded by full path with `pynvml` on top
(`discovery.nvml_library`), on the node the driver runs on and on one made from a profile alike
(`--profile`, `dra_gpu.node.profiles`). Such a node differs only in what its package prepared:
which driver root and dev root, the environment its library and NVIDIA's programs are told
(`tool_env`), and its kernel's event injection for `dra-gpu health simulate`. The PCIe roots come
from sysfs under the dev root on both (`/sys` on a real node).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dra_gpu.discovery.driver_versions import NVML_ERROR_LIB_RM_VERSION_MISMATCH, version_mismatch
from dra_gpu.discovery.nvml_discovery import NvmlUnavailableError, discover, sysfs_pcie_root
from dra_gpu.discovery.nvml_library import find_nvml, load_nvml
from dra_gpu.model.inventory import Inventory
from dra_gpu.node.profiles import NodeEvents, prepare_node
from dra_gpu.node.settings import REAL_DRIVER_ROOT

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeBackend:
    nvml: Any  # pynvml, bound to the driver root's libnvidia-ml.so.1
    driver_root: Path  # the NVIDIA driver's files, as this process sees them
    dev_root: Path  # root of dev/, proc/ and sys/ ("/" on a real node)
    nvml_library: Path  # the file libnvidia-ml.so.1 was loaded from (links resolved)
    tool_env: dict[str, str] = field(default_factory=dict)  # more environment for NVIDIA's tools
    events: NodeEvents | None = None  # a profile's node's event injection; None on a real one

    def discover(self, node_name: str, dynamic_mig: bool = False) -> Inventory:
        """The node's inventory. NvmlUnavailableError when NVML cannot be initialised; its
        DriverVersionMismatchError when NVML refuses the loaded kernel module (another driver's
        libraries), naming both versions."""
        try:
            return discover(self.nvml, node_name, sysfs_pcie_root(str(self.dev_root / "sys")), dynamic_mig)
        except NvmlUnavailableError as exc:
            cause = exc.__cause__
            if getattr(cause, "value", None) == NVML_ERROR_LIB_RM_VERSION_MISMATCH:
                raise version_mismatch(self.nvml_library, self.driver_root, self.dev_root) from cause
            raise


def open_backend(
    profile: str | None, driver_root: Path | None, dev_root: Path, cache_dir: Path | None = None
) -> NodeBackend:
    """The node's backend. `profile`: the node of a profile (a built-in name or a file), prepared
    under `dev_root` with `driver_root` or, when None, the profile package's own driver root (built
    on first use in `cache_dir`). Otherwise this node: NVML of `driver_root` (default "/").

    NvmlUnavailableError: no NVML in the driver root; NodePreparationError: the profile's node
    cannot be had (says why: an invalid profile, something missing, no profile package)."""
    if profile is None:
        root = driver_root or REAL_DRIVER_ROOT
        library = find_nvml(root)
        return NodeBackend(_load(library, root), root, dev_root, library)
    node = prepare_node(profile, dev_root, driver_root, cache_dir)
    library = find_nvml(node.driver_root)
    return NodeBackend(
        _load(library, node.driver_root),
        node.driver_root,
        dev_root,
        library,
        tool_env=dict(node.tool_env),
        events=node.events,
    )


def _load(library: Path, driver_root: Path) -> Any:
    """pynvml bound to `library`, said in one line (what an operator checks first)."""
    nvml = load_nvml(library)
    log.info("NVML loaded library=%s driver_root=%s", library, driver_root)
    return nvml
