"""A driver upgrade under a serving plugin: the node's driver root moves from 535.261.03 to
550.163.01 (dpkg replacing the files in place, or a driver container's root swapped), then the
kernel module follows.

- While the libraries and the module disagree, a new claim is refused naming both versions and
  nothing is written (no spec, no checkpoint entry); the claim prepared before keeps its spec.
- Once they agree on 550, the plugin (still holding 535's NVML) refuses and asks to be restarted;
  the restarted plugin rewrites the old claim's spec with 550's files (what a restarting container
  of it reads) and prepares new claims with them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from simnode.node import kernel_version_text

from dra_gpu.common.exit_codes import EXIT_DRIVER_CHANGED, EXIT_OK
from dra_gpu.kubeletplugin.driver import ClaimRef
from dra_gpu.node.backend import NodeBackend
from dra_gpu.node.settings import NodeSettings
from dra_gpu.plugin.driver_files import DriverFiles
from dra_gpu.plugin.driver_upgrade import POLL_SECONDS, DriverState, DriverVersions, DriverVersionWatch
from dra_gpu.plugin.plan import PrepareError
from dra_gpu.plugin.server import KubeletPlugin, PluginConfig
from plugin.conftest import PluginCore, claim, gpu_names, prepare_claim
from tests.driver_root import make_root

OLD, NEW = "535.261.03", "550.163.01"
LIBDIR = "usr/lib/x86_64-linux-gnu"


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A driver root of each version (built once: real ELF files under their real names)."""
    base = tmp_path_factory.mktemp("drivers")
    return {v: make_root(base / v, v) for v in (OLD, NEW)}


def set_module(node: Path, version: str) -> None:
    """The loaded kernel module's version, as /proc/driver/nvidia/version says it."""
    proc = node / "proc/driver/nvidia"
    proc.mkdir(parents=True, exist_ok=True)
    (proc / "version").write_text(kernel_version_text(version))


def swap_root(link: Path, target: Path) -> None:
    """A driver container's root replaced: the root's path now names the other files (atomic)."""
    tmp = link.with_name(link.name + ".new")
    tmp.symlink_to(target)
    tmp.replace(link)


def upgrade_in_place(root: Path, new: Path) -> None:
    """dpkg's way: the new version's files written under the same root, its links moved, the old
    version's files removed."""
    for path in sorted(new.rglob("*")):
        dest = root / path.relative_to(new)
        if path.is_dir() and not path.is_symlink():
            dest.mkdir(parents=True, exist_ok=True)
        else:
            tmp = dest.with_name(f".{dest.name}.dpkg-new")
            tmp.unlink(missing_ok=True)
            if path.is_symlink():
                tmp.symlink_to(path.readlink())
            else:
                shutil.copy2(path, tmp)
            tmp.replace(dest)
    for old in (root / LIBDIR).glob(f"*.so.{OLD}"):
        old.unlink()
    shutil.rmtree(root / "lib/firmware/nvidia" / OLD)


def ref_of(c: dict) -> ClaimRef:
    m = c["metadata"]
    return ClaimRef(m["namespace"], m["uid"], m["name"])


def new_claim(core: PluginCore, device: str) -> dict:
    c = claim(str(uuid.uuid4()), [device])
    core.add(c)
    return c


def prepare(core: PluginCore, c: dict) -> list:
    return asyncio.run(prepare_claim(core.preparer, ref_of(c)))


def spec_versions(core: PluginCore, c: dict) -> set[str]:
    """The driver versions whose library files a claim's spec mounts."""
    spec = json.loads(core.cdi.path(c["metadata"]["uid"]).read_text())
    hosts = [m["hostPath"] for m in spec["containerEdits"]["mounts"]]
    return {h.rsplit(".so.", 1)[1] for h in hosts if "libcuda.so." in h}


def serve(core: PluginCore, root: Path, node: Path, loaded: str, upgraded: list[DriverVersions]) -> None:
    """The core's driver files as a plugin that loaded `loaded`'s NVML finds them."""
    watch = DriverVersionWatch(root, node, loaded, on_upgraded=upgraded.append)
    core.preparer.driver_files = DriverFiles(root, loaded, watch=watch)


Layout = Callable[[Path, dict[str, Path]], tuple[Path, Callable[[], None]]]


def swapped(base: Path, versions: dict[str, Path]) -> tuple[Path, Callable[[], None]]:
    """The driver root a link to 535's files, then to 550's."""
    root = base / "driver"
    root.symlink_to(versions[OLD])
    return root, lambda: swap_root(root, versions[NEW])


def in_place(base: Path, versions: dict[str, Path]) -> tuple[Path, Callable[[], None]]:
    """The driver root a directory of 535's files, upgraded in place."""
    root = base / "driver"
    shutil.copytree(versions[OLD], root, symlinks=True)
    return root, lambda: upgrade_in_place(root, versions[NEW])


@pytest.mark.parametrize("layout", [swapped, in_place], ids=["root-swapped", "dpkg-in-place"])
def test_an_upgrade_under_prepared_claims(
    core: PluginCore, tmp_path: Path, versions: dict[str, Path], layout: Layout
) -> None:
    node = tmp_path / "node"
    set_module(node, OLD)
    root, upgrade = layout(tmp_path, versions)
    upgraded: list[DriverVersions] = []
    serve(core, root, node, OLD, upgraded)
    g0, g1, g2 = gpu_names(core)[:3]

    before = new_claim(core, g0)
    prepare(core, before)
    assert spec_versions(core, before) == {OLD}
    old_spec = core.cdi.path(before["metadata"]["uid"]).read_bytes()

    # The packages are upgraded on disk; the module is still 535's.
    upgrade()
    during = new_claim(core, g1)
    with pytest.raises(PrepareError) as refused:
        prepare(core, during)
    said = str(refused.value)
    assert f"libraries under {root} are version {NEW}" in said, said
    assert f"loaded kernel module is version {OLD}" in said, said
    assert "nothing was written" in said, said
    assert not core.cdi.path(during["metadata"]["uid"]).exists()
    assert core.checkpoint.get(during["metadata"]["uid"]) is None
    assert core.cdi.path(before["metadata"]["uid"]).read_bytes() == old_spec  # untouched
    assert prepare(core, before)  # a prepared claim is answered from its record, nothing written
    assert core.cdi.path(before["metadata"]["uid"]).read_bytes() == old_spec
    assert not upgraded

    # The module is reloaded: 550 on disk and in the kernel, 535's NVML still in this process.
    set_module(node, NEW)
    with pytest.raises(PrepareError) as restart:
        prepare(core, during)
    assert f"driver changed from {OLD} to {NEW}" in str(restart.value)
    assert not core.cdi.path(during["metadata"]["uid"]).exists()
    assert core.checkpoint.get(during["metadata"]["uid"]) is None
    assert upgraded and upgraded[-1] == DriverVersions(OLD, NEW, NEW)

    # The restarted plugin: 550's NVML; its start rewrites the old claim's spec (what a restarting
    # container of it reads), and new claims get 550.
    core = core.restart()
    serve(core, root, node, NEW, upgraded)
    counts = core.preparer.reconcile()
    assert counts["rebuilt"] == 1, counts
    assert spec_versions(core, before) == {NEW}
    prepare(core, during)
    assert spec_versions(core, during) == {NEW}
    after = new_claim(core, g2)
    prepare(core, after)
    assert spec_versions(core, after) == {NEW}
    for c in (before, during, after):
        spec = json.loads(core.cdi.path(c["metadata"]["uid"]).read_text())
        for m in spec["containerEdits"]["mounts"]:  # every file it names is there
            assert Path(m["hostPath"]).exists(), m


def test_states_of_the_three_versions(tmp_path: Path, versions: dict[str, Path]) -> None:
    node = tmp_path / "node"
    root = tmp_path / "driver"
    root.symlink_to(versions[OLD])
    watch = DriverVersionWatch(root, node, OLD)
    assert watch.read() == DriverVersions(OLD, OLD, None)  # no proc file: libraries vs NVML only
    set_module(node, OLD)
    assert watch.read().state == DriverState.CURRENT
    swap_root(root, versions[NEW])
    assert watch.read().state == DriverState.MISMATCH
    set_module(node, NEW)
    assert watch.read().state == DriverState.UPGRADED
    swap_root(root, tmp_path / "nowhere")
    assert watch.read().state == DriverState.MISSING
    with pytest.raises(Exception, match=r"libnvidia-ml\.so\.1 is missing under"):
        watch.check()


def test_the_plugin_stops_to_load_the_new_nvml(
    tmp_path: Path, versions: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Libraries and module upgraded past the NVML the process loaded: the serving plugin's poll
    stops it with exit status 4 and one line naming both versions; a mismatch alone does not."""
    node = tmp_path / "node"
    set_module(node, OLD)
    root = tmp_path / "driver"
    root.symlink_to(versions[OLD])
    settings = NodeSettings(
        node_name="node-a",
        driver="gpu.dra-gpu.io",
        profile=None,
        plugin_dir=tmp_path / "p",
        registry_dir=tmp_path / "r",
        cdi_dir=tmp_path / "cdi",
        dev_root=node,
        driver_root=root,
    )
    plugin = KubeletPlugin(PluginConfig(settings))
    loaded = root / LIBDIR / f"libnvidia-ml.so.{OLD}"
    backend = NodeBackend(nvml=None, driver_root=root, dev_root=node, nvml_library=loaded)

    async def body() -> None:
        watch = plugin._watch_for(backend, "/run/nvidia/driver")
        assert watch is not None
        serving = asyncio.create_task(plugin._watch_driver(watch))
        swap_root(root, versions[NEW])  # the mismatch: refused prepares, the plugin keeps serving
        await asyncio.sleep(POLL_SECONDS * 1.5)
        assert not plugin.stopping.is_set() and plugin.exit_code == EXIT_OK
        set_module(node, NEW)
        await asyncio.wait_for(plugin.stopping.wait(), POLL_SECONDS * 3)
        serving.cancel()

    with caplog.at_level(logging.WARNING, logger="dra_gpu.plugin"):
        asyncio.run(body())
    assert plugin.exit_code == EXIT_DRIVER_CHANGED == 4
    assert plugin.driver_changed == DriverVersions(OLD, NEW, NEW)
    said = [r.getMessage() for r in caplog.records]
    assert any(f"libraries under /run/nvidia/driver are version {NEW}" in m and OLD in m for m in said), said
    (line,) = [m for m in said if "stopping" in m]
    assert f"driver changed from {OLD} to {NEW}" in line and "exit status 4" in line, line
