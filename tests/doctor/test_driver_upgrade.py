"""`node/driver-upgrade` at each state of an upgrade from 535.261.03 to 550.163.01: consistent,
libraries upgraded on disk with the old kernel module loaded, and upgraded with prepared claims'
specs still naming the old files (until the restarted plugin rewrites them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from simnode.node import kernel_version_text

from dra_gpu.doctor.node_checks import NodeFacts, check_driver_upgrade, run_node_checks
from dra_gpu.doctor.report import Status
from dra_gpu.doctor.settings import NodeCheckSettings
from tests.doctor.test_node_checks import DRIVER, settings
from tests.driver_root import make_root

OLD, NEW = "535.261.03", "550.163.01"


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("drivers")
    return {v: make_root(base / v, v) for v in (OLD, NEW)}


def set_module(dev_root: Path, version: str) -> None:
    proc = dev_root / "proc/driver/nvidia"
    proc.mkdir(parents=True, exist_ok=True)
    (proc / "version").write_text(kernel_version_text(version))


def point(root: Path, target: Path) -> None:
    root.unlink(missing_ok=True)
    root.symlink_to(target)


def write_spec(cdi_dir: Path, uid: str, version: str) -> None:
    """A prepared claim's spec as the plugin writes it: the driver's libraries by versioned path."""
    libdir = "/run/nvidia/driver/usr/lib/x86_64-linux-gnu"
    mounts = [
        {"hostPath": f"{libdir}/{name}.so.{version}", "containerPath": f"/usr/lib/{name}.so.1"}
        for name in ("libcuda", "libnvidia-ml")
    ] + [{"hostPath": f"{libdir}/libnvidia-egl-wayland.so.1.1.13", "containerPath": "/x"}]
    cdi_dir.mkdir(exist_ok=True)
    spec = {"cdiVersion": "0.5.0", "kind": f"k8s.{DRIVER}/claim", "containerEdits": {"mounts": mounts}}
    (cdi_dir / f"k8s.{DRIVER}-claim_{uid}.json").write_text(json.dumps(spec))


def row(s: NodeCheckSettings) -> tuple[Status, str]:
    (r,) = check_driver_upgrade(NodeFacts(s))
    return r.status, r.detail


def test_each_state_of_an_upgrade(tmp_path: Path, versions: dict[str, Path]) -> None:
    s = settings(tmp_path)
    point(s.driver_root, versions[OLD])
    set_module(s.dev_root, OLD)
    write_spec(s.cdi_dir, "uid-1", OLD)
    status, detail = row(s)
    assert status is Status.OK, detail
    assert f"driver {OLD} (libraries and kernel module); 1 prepared claims' specs name its files" in detail

    point(s.driver_root, versions[NEW])  # the packages upgraded, the module not reloaded
    status, detail = row(s)
    assert status is Status.FAIL, detail
    assert f"libraries under {s.driver_root} are version {NEW}" in detail, detail
    assert f"loaded kernel module is version {OLD}" in detail, detail

    set_module(s.dev_root, NEW)  # the module reloaded; the plugin has not rewritten the spec yet
    write_spec(s.cdi_dir, "uid-2", NEW)
    status, detail = row(s)
    assert status is Status.WARN, detail
    assert f"driver upgraded to {NEW}" in detail, detail
    assert f"1 of 2 prepared claims' CDI specs still name driver {OLD}'s files" in detail, detail

    write_spec(s.cdi_dir, "uid-1", NEW)  # the restarted plugin's reconcile
    status, detail = row(s)
    assert status is Status.OK, detail
    assert f"driver {NEW} (libraries and kernel module); 2 prepared claims' specs name its files" in detail


def test_the_row_is_in_the_node_report(tmp_path: Path, versions: dict[str, Path]) -> None:
    s = settings(tmp_path)
    point(s.driver_root, versions[NEW])
    set_module(s.dev_root, OLD)
    rows = {r.check: r for r in run_node_checks(s)}
    assert rows["node/driver-upgrade"].status is Status.FAIL
    assert NEW in rows["node/driver-upgrade"].detail and OLD in rows["node/driver-upgrade"].detail
