"""`node/driver-upgrade`: where a driver upgrade on the node stands, from the same three versions
the plugin watches (`dra_gpu.plugin.driver_upgrade`) plus the one the prepared claims' CDI specs
were written for:

- consistent: the driver root's libraries and the loaded kernel module are one version, and every
  prepared claim's spec names that version's files;
- libraries upgraded, module old: the plugin refuses new claims until they agree;
- upgraded (libraries and module agree) while prepared claims' specs still name the old version's
  files: the plugin has not restarted on the new driver yet (it does by itself, and rewrites them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from dra_gpu.common.exit_codes import EXIT_DRIVER_CHANGED
from dra_gpu.discovery.driver_versions import KERNEL_VERSION_FILE, kernel_module_version
from dra_gpu.discovery.nvml_library import NVML_SONAME
from dra_gpu.doctor.report import Result, fail, ok, skip, warn
from dra_gpu.doctor.settings import NodeCheckSettings
from dra_gpu.plugin.cdi import CdiSpecs
from dra_gpu.plugin.driver_upgrade import library_file_version

NAME = "node/driver-upgrade"
# The driver's own version in the file names a spec mounts (other libraries carry their own).
_DRIVER_LIBRARY = re.compile(r"/lib(?:cuda|nvidia-ml)\.so\.(\d+\.\d+(?:\.\d+)?)$")
MAX_SPEC_BYTES = 4 << 20  # a claim's spec is a few KiB; larger is not the plugin's


def spec_driver_versions(cdi: CdiSpecs) -> dict[str, set[str]]:
    """Claim UID -> the driver versions whose libraries its spec mounts."""
    found: dict[str, set[str]] = {}
    for uid, path in sorted(cdi.owned().items()):
        try:
            if path.stat().st_size > MAX_SPEC_BYTES:
                continue
            spec = json.loads(path.read_bytes())
            mounts = (spec.get("containerEdits") or {}).get("mounts") or []
            hosts = [str(m.get("hostPath", "")) for m in mounts if isinstance(m, dict)]
        except (OSError, ValueError, AttributeError):
            continue  # node/prepared-claims reports unreadable specs
        found[uid] = {m.group(1) for h in hosts if (m := _DRIVER_LIBRARY.search(h))}
    return found


def driver_upgrade_results(s: NodeCheckSettings, root: Path) -> Iterable[Result]:
    """The row for the node of `s` whose driver files are under `root` (as this process sees them)."""
    libraries = library_file_version(root)
    if libraries is None:
        yield skip(NAME, f"no {NVML_SONAME} under {root}")
        return
    module = kernel_module_version(s.dev_root)
    if module is not None and libraries and module != libraries:
        yield fail(
            NAME,
            f"the driver libraries under {root} are version {libraries} but the loaded kernel module is "
            f"version {module}: the driver was upgraded on disk and the module not reloaded; the "
            "plugin refuses new claims, naming both versions, until they agree (running containers "
            "keep their files)",
            "reboot the node, or stop the GPU workloads and the plugin and reload the NVIDIA kernel modules "
            "(`modprobe -r nvidia_uvm nvidia_drm nvidia_modeset nvidia && modprobe nvidia`)",
        )
        return
    specs = spec_driver_versions(CdiSpecs(s.cdi_dir, s.driver))
    stale = {uid: vs for uid, vs in specs.items() if libraries and vs and vs != {libraries}}
    where = (
        "libraries and kernel module"
        if module is not None
        else f"libraries; no kernel module version to compare ({s.dev_root / KERNEL_VERSION_FILE} missing)"
    )
    if stale:
        old = ", ".join(sorted(set().union(*stale.values()) - {libraries}))
        yield warn(
            NAME,
            f"driver upgraded to {libraries} ({where}), but {len(stale)} of {len(specs)} prepared "
            f"claims' CDI specs still name driver {old}'s files: a container of theirs that restarts "
            "cannot start until they are rewritten",
            "the plugin rewrites them at its start, and restarts by itself once it sees the upgrade (exit "
            f"status {EXIT_DRIVER_CHANGED}); if it has not within a minute, restart the plugin's pod",
        )
        return
    yield ok(
        NAME,
        f"driver {libraries or '(unversioned)'} ({where}); "
        f"{len(specs)} prepared claims' specs name its files",
    )
