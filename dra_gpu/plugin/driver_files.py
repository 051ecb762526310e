"""CDI container edits that give a container the node's NVIDIA driver user space.

The files (`dra_gpu.discovery.driver_install`) are the same for every claim on a node, so they are
found once, turned into edits once, and the same edits go into every claim's own spec. Where the
container finds them:
- every versioned library is bind-mounted at its own path (host path minus the driver root), and
  again at its SONAME (`libcuda.so.1`) in the same directory and at every link the driver root has
  to it in its library directories (Debian's alternatives links `/usr/lib/x86_64-linux-gnu/libcuda.so.1`
  for a library in `.../nvidia/current/`), so the loader's default search path finds it without an
  ld cache update in any image whose default path includes that directory (Debian/Ubuntu images
  on a Debian or Ubuntu/`.run`-layout driver root);
- binaries, firmware and sockets where the driver root's own system has them (`/usr/bin/nvidia-smi`,
  Debian's link to `/usr/lib/nvidia/current/nvidia-smi`);
- the host path of every mount is the file itself (every link resolved inside the driver root):
  the runtime resolves host paths in the host's namespace, where an absolute link of a driver root
  mounted elsewhere (`/run/nvidia/driver`) would name the host's own file, or none;
- the SONAMEs are also mounted under `/usr/local/nvidia/lib64` and the binaries under
  `/usr/local/nvidia/bin`, the layout CUDA-style images put on `LD_LIBRARY_PATH` and `PATH`;
- with a CDI hook program (`--cdi-hook-path`, NVIDIA's `nvidia-cdi-hook`) the spec carries the
  hooks NVIDIA's own generator adds for the driver's libraries, in its order: `create-symlinks`
  (the SONAME and development links beside each library, made as links instead of the bind
  mounts above), `enable-cuda-compat` (an image's CUDA forward-compat libraries when they are
  newer than the driver), `update-ldcache` (the library directories into the container's ld
  cache, for images whose loader searches none of the directories the files are mounted in) and
  `disable-device-node-modification` (NVIDIA's libraries in the container may not create device
  nodes). Only the hooks the program has (`cdi_hook`, asked at start) are named: an older toolkit
  gets a spec without the newer hooks instead of containers that fail to start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dra_gpu.discovery.driver_install import DriverInstallation, Library, discover_installation
from dra_gpu.plugin.cdi_hook import (
    CREATE_SYMLINKS,
    DISABLE_DEVICE_NODE_MODIFICATION,
    ENABLE_CUDA_COMPAT,
    OPTIONAL,
    UPDATE_LDCACHE,
    CdiHook,
    argv_prefix,
    probe_for_driver_files,
)
from dra_gpu.plugin.driver_upgrade import DriverUpgradeError, DriverVersionWatch

log = logging.getLogger(__name__)

CUDA_STYLE_LIB_DIR = "/usr/local/nvidia/lib64"
CUDA_STYLE_BIN_DIR = "/usr/local/nvidia/bin"
FILE_OPTIONS = ["ro", "nosuid", "nodev", "rbind", "rprivate"]
SOCKET_OPTIONS = ["nosuid", "nodev", "rbind", "rprivate", "noexec"]
# A broken installation is looked at again at most this often (a driver container may still be
# installing it when the plugin starts), so a claim's retry can succeed without a restart.
REDISCOVER_SECONDS = 10.0


class DriverInstallationError(RuntimeError):
    """The driver's user space cannot be given to a container (missing files, wrong version)."""


def _host(root: str, rel: str) -> str:
    return os.path.join(root, rel) if root != "/" else "/" + rel


def _links_beside(lib: Library) -> dict[str, str]:
    """Container path -> target of the links NVIDIA's `create-symlinks` makes beside a library:
    its SONAME (`libcuda.so.1 -> libcuda.so.550.163.01`) and its development link where the root
    has one (`libcuda.so -> libcuda.so.1` always: many programs dlopen it)."""
    directory, file = os.path.split(lib.path)
    out: dict[str, str] = {}
    if lib.soname and lib.soname != file:
        out[f"/{directory}/{lib.soname}"] = file
    dev_link = os.path.join(directory, lib.name)
    if lib.name == "libcuda.so" or dev_link in lib.links:
        target = lib.soname or file
        if target != lib.name:
            out["/" + dev_link] = target
    return out


def _hook(hook_path: str, name: str, args: list[str]) -> dict[str, Any]:
    return {
        "hookName": "createContainer",
        "path": hook_path,
        "args": [*argv_prefix(hook_path), name, *args],
        "env": ["NVIDIA_CTK_DEBUG=false"],
    }


def container_edits(
    found: DriverInstallation, hook_path: str | None = None, hooks_known: frozenset[str] | None = None
) -> dict[str, Any]:
    """The CDI `containerEdits` (mounts, and hooks when a hook program is given) for `found`.
    `hooks_known`: the subcommands the program has (`CdiHook.subcommands`); None: all of ours."""
    mounts: list[dict[str, Any]] = []
    targets: set[str] = set()

    def known(name: str) -> bool:
        return bool(hook_path) and (hooks_known is None or name in hooks_known)

    links: dict[str, str] = {}  # made by create-symlinks (with a hook program), not mounted
    if known(CREATE_SYMLINKS):
        for lib in found.libraries:
            links.update(_links_beside(lib))
        targets.update(links)

    def mount(rel: str, container_path: str, options: list[str]) -> None:
        if container_path in targets:
            return
        targets.add(container_path)
        mounts.append(
            {"hostPath": _host(found.root, rel), "containerPath": container_path, "options": options}
        )

    for lib in found.libraries:
        directory = "/" + os.path.dirname(lib.path)
        mount(lib.path, "/" + lib.path, FILE_OPTIONS)
        for link in lib.links:
            mount(lib.path, "/" + link, FILE_OPTIONS)
        if lib.soname:
            mount(lib.path, f"{directory}/{lib.soname}", FILE_OPTIONS)
            mount(lib.path, f"{CUDA_STYLE_LIB_DIR}/{lib.soname}", FILE_OPTIONS)
        if lib.name == "libcuda.so":  # what CUDA build systems link against
            mount(lib.path, f"{directory}/libcuda.so", FILE_OPTIONS)
    for rel in found.binaries:
        container_path = found.container_path(rel)
        mount(rel, container_path, FILE_OPTIONS)
        mount(rel, f"{CUDA_STYLE_BIN_DIR}/{os.path.basename(container_path)}", FILE_OPTIONS)
    for rel in found.firmware:
        mount(rel, found.container_path(rel), FILE_OPTIONS)
    for rel in found.ipc_sockets:
        mount(rel, found.container_path(rel), SOCKET_OPTIONS)
    edits: dict[str, Any] = {"mounts": mounts}
    if hook_path:
        folders = ["/" + d for d in found.library_dirs()] + [CUDA_STYLE_LIB_DIR]
        wanted = [
            (CREATE_SYMLINKS, [a for p, t in links.items() for a in ("--link", f"{t}::{p}")]),
            (ENABLE_CUDA_COMPAT, [f"--host-driver-version={found.version}"]),
            (UPDATE_LDCACHE, [a for f in folders for a in ("--folder", f)]),
            (DISABLE_DEVICE_NODE_MODIFICATION, []),
        ]
        edits["hooks"] = [
            _hook(hook_path, name, args)
            for name, args in wanted
            if known(name) and (name != CREATE_SYMLINKS or links)
        ]
    return edits


class DriverFiles:
    """The node's driver installation, found once and looked at again only while it is broken.

    With a `watch`, every call for the edits first checks that the driver on disk is still the
    one this process loaded (`driver_upgrade`): a changed driver is never given out from the files
    found at the start, and the edits are found again only by the restarted process.

    With a `hook_path` the program is asked at once what it has (`cdi_hook`): one that cannot run
    or lacks a hook the edits need raises CdiHookError, and the plugin does not start, since every
    container of every claim would fail at the runtime's hook instead."""

    def __init__(
        self,
        root: Path,
        version: str | None,
        host_root: str | None = None,
        hook_path: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        watch: DriverVersionWatch | None = None,
    ) -> None:
        self.root = root
        self.watch = watch
        self.host_root = host_root or str(root)
        self.version = version
        self.hook_path = hook_path
        self.hook: CdiHook | None = probe_for_driver_files(hook_path) if hook_path else None
        if self.hook is not None:
            self._say_hook(self.hook)
        self._clock = clock
        self._checked_at = float("-inf")
        self._edits: dict[str, Any] | None = None
        self.digest: str | None = None  # of the edits, recorded with each claim
        self.installation: DriverInstallation | None = None
        self.refresh()

    @staticmethod
    def _say_hook(hook: CdiHook) -> None:
        log.info(
            "CDI hook path=%s version=%s hooks=%s",
            hook.path,
            hook.version,
            ",".join(sorted(hook.subcommands)),
        )
        missing = hook.missing_optional()
        if missing:
            log.warning(
                "CDI hook %s version %s has no %s: left out of every claim's spec, so %s",
                hook.path,
                hook.version,
                ", ".join(missing),
                "; and ".join(f"without {name} {OPTIONAL[name]}" for name in missing),
            )

    def refresh(self) -> DriverInstallation | None:
        self._checked_at = self._clock()
        if self.version is None:
            self.installation = None
            log.error("driver installation: NVML reported no driver version root=%s", self.root)
            return None
        found = discover_installation(self.root, self.version, self.host_root)
        self.installation = found
        if found.error:
            self._edits = None
            log.error("driver installation unusable root=%s error=%s", found.root, found.error)
        else:
            known = self.hook.subcommands if self.hook is not None else None
            self._edits = container_edits(found, self.hook_path, known)
            canonical = json.dumps(self._edits, sort_keys=True, separators=(",", ":")).encode()
            self.digest = hashlib.sha256(canonical).hexdigest()[:16]
            log.info(
                "driver installation root=%s version=%s libraries=%d binaries=%d firmware=%d "
                "ipc=%d missing_optional=%s",
                found.root,
                found.version,
                len(found.libraries),
                len(found.binaries),
                len(found.firmware),
                len(found.ipc_sockets),
                ",".join(found.missing_optional) or "-",
            )
        return found

    def edits(self) -> dict[str, Any]:
        """The shared container edits; raises DriverInstallationError while they can't be made
        or the driver on disk is no longer the one they were made of."""
        if self.watch is not None:
            try:
                self.watch.check()
            except DriverUpgradeError as exc:
                raise DriverInstallationError(str(exc)) from exc
        if self._edits is None and self._clock() - self._checked_at >= REDISCOVER_SECONDS:
            self.refresh()
        if self._edits is not None:
            return self._edits
        if self.installation is None:
            raise DriverInstallationError(f"driver installation under {self.host_root}: no driver version")
        raise DriverInstallationError(str(self.installation.error))
