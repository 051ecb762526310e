"""Node checks on simulated nodes in temp dirs: device nodes, driver files, CDI dir, containerd's
config, the plugin's sockets (a real gRPC server on a unix socket) and the prepared claims."""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from simnode.fake import discover_node

from dra_gpu.doctor.containerd_config import ContainerdConfigError, read_containerd_cdi
from dra_gpu.doctor.node_checks import (
    NodeFacts,
    check_cdi_dir,
    check_containerd_cdi,
    check_device_nodes,
    check_driver,
    check_driver_files,
    check_nvidia_uvm,
    check_nvml,
    check_plugin_registration,
    check_plugin_service,
    check_prepared_claims,
    run_node_checks,
)
from dra_gpu.doctor.plugin_probe import GET_INFO, decode_plugin_info
from dra_gpu.doctor.report import Status
from dra_gpu.doctor.settings import NodeCheckSettings as NodeSettings
from dra_gpu.kubeletplugin._proto import pluginregistration_v1_pb2 as reg_pb
from tests.driver_root import make_root
from tests.fake_node import create_simulated

DRIVER = "gpu.dra-gpu.io"

V3 = """version = 3
[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = true
  cdi_spec_dirs = [{dirs}]
"""


def settings(tmp: Path, profile: str | None = "hgx-2x4", **over: object) -> NodeSettings:
    base: dict[str, object] = dict(
        node_name="node-a",
        driver=DRIVER,
        profile=profile,
        plugin_dir=tmp / "plugin",
        registry_dir=tmp / "registry",
        cdi_dir=tmp / "cdi",
        dev_root=tmp / "root",
        driver_root=tmp / "driver",
        containerd_config=tmp / "containerd.toml",
        timeout=2.0,
    )
    base.update(over)
    return NodeSettings(**base)  # type: ignore[arg-type]


def statuses(results: object) -> list[Status]:
    return [r.status for r in results]  # type: ignore[attr-defined]


def test_nvml_and_driver_on_a_simulated_node(tmp_path: Path) -> None:
    facts = NodeFacts(settings(tmp_path))
    (nvml,) = check_nvml(facts)
    assert nvml.status is Status.OK and "8 GPUs" in nvml.detail and "570.133.20" in nvml.detail
    assert statuses(check_driver(facts)) == [Status.OK]


def test_kernel_module_and_libraries_of_different_versions(tmp_path: Path) -> None:
    s = settings(tmp_path)
    version_file = s.dev_root / "proc/driver/nvidia/version"
    version_file.parent.mkdir(parents=True)
    version_file.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  565.57.01  Thu Oct 10 2024\n")
    (r,) = check_driver(NodeFacts(s))
    assert r.status is Status.FAIL and "565.57.01" in r.detail and "570.133.20" in r.detail


@pytest.mark.parametrize(
    "line",
    [
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.133.20  Fri Feb 28 2025",
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.133.20  Release Build  (dvs-builder)",
    ],
)
def test_kernel_module_of_the_same_version(tmp_path: Path, line: str) -> None:
    s = settings(tmp_path)
    version_file = s.dev_root / "proc/driver/nvidia/version"
    version_file.parent.mkdir(parents=True)
    version_file.write_text(line + "\nGCC version:  gcc version 12.2.0\n")
    (r,) = check_driver(NodeFacts(s))
    assert r.status is Status.OK and "570.133.20" in r.detail


def test_no_nvml_is_said_once_and_fails(tmp_path: Path) -> None:
    nvml, rest = run_node_checks(settings(tmp_path, profile=None, dev_root=tmp_path / "empty"))
    assert nvml.status is Status.FAIL and nvml.detail.startswith(
        "not a GPU node: NVML is not available: no libnvidia-ml.so.1"
    )
    assert "(searched" not in nvml.detail and "--driver-root" in nvml.fix
    assert rest.status is Status.SKIP and rest.detail.endswith("node checks: not run without a GPU")


def test_device_nodes_present_then_one_missing(tmp_path: Path) -> None:
    s = settings(tmp_path, profile="dgx-a100-mig")
    create_simulated(discover_node("node-a", "dgx-a100-mig"), s.dev_root)
    facts = NodeFacts(s)
    (r,) = check_device_nodes(facts)
    assert r.status is Status.OK, r.detail
    (s.dev_root / "dev/nvidia3").unlink()
    (r,) = check_device_nodes(facts)
    assert r.status is Status.FAIL and "/dev/nvidia3 missing" in r.detail
    assert "restart the kubelet plugin" in r.fix


def test_mig_capability_nodes_are_not_needed_on_the_host_the_kernels_caps_major_is(tmp_path: Path) -> None:
    """The claims' specs carry /dev/nvidia-caps nodes by number: no host node needed (NVML makes
    none), but the kernel must list nvidia-caps."""
    s = settings(tmp_path, profile="dgx-a100-mig")
    create_simulated(discover_node("node-a", "dgx-a100-mig"), s.dev_root)
    shutil.rmtree(s.dev_root / "dev/nvidia-caps")
    facts = NodeFacts(s)
    (r,) = check_device_nodes(facts)
    assert r.status is Status.OK, r.detail
    proc = s.dev_root / "proc/devices"
    proc.write_text("".join(line for line in proc.read_text().splitlines(True) if "nvidia-caps" not in line))
    (r,) = check_device_nodes(facts)
    assert r.status is Status.FAIL and "no nvidia-caps in /proc/devices" in r.detail


def test_device_node_that_is_a_plain_file(tmp_path: Path) -> None:
    s = settings(tmp_path)
    create_simulated(discover_node("node-a", "hgx-2x4"), s.dev_root)
    (s.dev_root / "dev/nvidiactl").unlink()
    (s.dev_root / "dev/nvidiactl").write_text("")
    (r,) = check_device_nodes(NodeFacts(s))
    assert r.status is Status.FAIL and "/dev/nvidiactl not a character device" in r.detail


def test_driver_files_complete_and_of_another_version(tmp_path: Path) -> None:
    s = settings(tmp_path)
    make_root(s.driver_root)
    (r,) = check_driver_files(NodeFacts(s))
    assert r.status is Status.OK, r.detail
    other = settings(tmp_path, driver_root=tmp_path / "old")
    make_root(other.driver_root, version="565.57.01")
    (r,) = check_driver_files(NodeFacts(other))
    assert r.status is Status.FAIL and "version mismatch" in r.detail and "565.57.01" in r.detail


def test_cdi_dir_missing_and_present(tmp_path: Path) -> None:
    s = settings(tmp_path)
    facts = NodeFacts(s)
    assert statuses(check_cdi_dir(facts)) == [Status.FAIL]
    s.cdi_dir.mkdir()
    assert statuses(check_cdi_dir(facts)) == [Status.OK]


def test_containerd_reads_the_plugins_cdi_dir(tmp_path: Path) -> None:
    s = settings(tmp_path)
    s.containerd_config.write_text(V3.format(dirs=f"'/etc/cdi', '{s.cdi_dir}'"))
    (r,) = check_containerd_cdi(NodeFacts(s))
    assert r.status is Status.OK, r.detail


def test_containerd_reads_another_cdi_dir(tmp_path: Path) -> None:
    s = settings(tmp_path)
    s.containerd_config.write_text(V3.format(dirs="'/etc/cdi'"))
    (r,) = check_containerd_cdi(NodeFacts(s))
    assert r.status is Status.FAIL
    assert f"not from {s.cdi_dir}" in r.detail and "cdi_spec_dirs" in r.fix


def test_containerd_with_cdi_off(tmp_path: Path) -> None:
    s = settings(tmp_path)
    s.containerd_config.write_text(
        "version = 3\n[plugins.'io.containerd.cri.v1.runtime']\nenable_cdi = false\n"
    )
    (r,) = check_containerd_cdi(NodeFacts(s))
    assert r.status is Status.FAIL and "enable_cdi = true" in r.fix


def test_containerd_config_defaults_and_imports(tmp_path: Path) -> None:
    main = tmp_path / "config.toml"
    (tmp_path / "conf.d").mkdir()
    (tmp_path / "conf.d" / "cdi.toml").write_text(V3.format(dirs="'/opt/cdi'"))
    main.write_text("version = 3\nimports = ['conf.d/*.toml']\n")
    cfg = read_containerd_cdi(main)
    assert cfg.enabled is True and cfg.spec_dirs == ["/opt/cdi"] and not cfg.spec_dirs_default
    main.write_text("version = 2\n")
    cfg = read_containerd_cdi(main)
    assert cfg.enabled is None and cfg.spec_dirs == ["/etc/cdi", "/var/run/cdi"] and cfg.spec_dirs_default
    main.write_text("version = [")
    with pytest.raises(ContainerdConfigError, match="not valid TOML"):
        read_containerd_cdi(main)


def test_plugin_info_decoding() -> None:
    raw = reg_pb.PluginInfo(
        type="DRAPlugin", name=DRIVER, endpoint="/x/dra.sock", supported_versions=["v1.DRAPlugin", "b"]
    ).SerializeToString()
    info = decode_plugin_info(raw)
    assert (info.type, info.name, info.endpoint) == ("DRAPlugin", DRIVER, "/x/dra.sock")
    assert info.supported_versions == ["v1.DRAPlugin", "b"]


@pytest.fixture
def registration_server(tmp_path: Path) -> Iterator[tuple[NodeSettings, list[str]]]:
    """A registration socket answering GetInfo for `names[0]`, and a DRA socket (real gRPC)."""
    s = settings(tmp_path)
    s.registry_dir.mkdir()
    s.plugin_dir.mkdir()
    names = [DRIVER]

    def get_info(_request: bytes, _context: object) -> bytes:
        return reg_pb.PluginInfo(
            type="DRAPlugin", name=names[0], endpoint=str(s.dra_socket), supported_versions=["v1.DRAPlugin"]
        ).SerializeToString()

    def prepare(_request: bytes, _context: object) -> bytes:
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    service, method = GET_INFO.lstrip("/").split("/")
    handlers = {method: grpc.unary_unary_rpc_method_handler(get_info)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    dra = {"NodePrepareResources": grpc.unary_unary_rpc_method_handler(prepare)}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin", dra),)
    )
    server.add_insecure_port(f"unix://{s.registration_socket}")
    server.add_insecure_port(f"unix://{s.dra_socket}")
    server.start()
    yield s, names
    server.stop(grace=None)


def test_plugin_registered_and_serving(registration_server: tuple[NodeSettings, list[str]]) -> None:
    s, _ = registration_server
    facts = NodeFacts(s)
    (reg,) = check_plugin_registration(facts)
    assert reg.status is Status.OK, reg.detail
    (svc,) = check_plugin_service(facts)
    assert svc.status is Status.OK, svc.detail


def test_plugin_answering_for_another_driver(registration_server: tuple[NodeSettings, list[str]]) -> None:
    s, names = registration_server
    names[0] = "gpu.example.com"
    (reg,) = check_plugin_registration(NodeFacts(s))
    assert reg.status is Status.FAIL and "gpu.example.com" in reg.detail


def test_plugin_stopped_leaves_a_stale_socket(tmp_path: Path) -> None:
    s = settings(tmp_path)
    s.registry_dir.mkdir()
    with socket.socket(socket.AF_UNIX) as sock:  # bound, then closed: nobody listens
        sock.bind(str(s.registration_socket))
    (reg,) = check_plugin_registration(NodeFacts(s))
    assert (
        reg.status is Status.FAIL
        and "does not answer" in reg.detail
        and "start the kubelet plugin" in reg.fix
    )
    (svc,) = check_plugin_service(NodeFacts(s))
    assert svc.status is Status.FAIL and "no DRA socket" in svc.detail


def _checkpoint(s: NodeSettings, claims: dict[str, object]) -> None:
    s.plugin_dir.mkdir(parents=True, exist_ok=True)
    s.checkpoint.write_text(json.dumps({"version": 1, "checksum": "x", "data": {"claims": claims}}))


def test_a_dynamic_mig_claims_device_is_known(tmp_path: Path) -> None:
    s = settings(tmp_path, profile="dgx-h100-mig")
    s.cdi_dir.mkdir()
    (s.cdi_dir / f"k8s.{DRIVER}-claim_uid-1.json").write_text("{}")
    device = {"deviceName": "gpu-0000-18-00-0-mig-3g40gb-4"}
    _checkpoint(s, {"uid-1": {"state": "completed", "namespace": "ns", "name": "c1", "devices": [device]}})
    (r,) = check_prepared_claims(NodeFacts(s))
    assert r.status is Status.OK, r.detail


def test_prepared_claims_need_their_spec_and_devices(tmp_path: Path) -> None:
    s = settings(tmp_path, profile="dgx-a100-mig")
    inv = discover_node("node-a", "dgx-a100-mig")
    gpu = next(g for g in inv.gpus if g.mig_devices)
    mig_name = gpu.mig_device_name(gpu.mig_devices[0])
    s.cdi_dir.mkdir()
    (s.cdi_dir / f"k8s.{DRIVER}-claim_uid-1.json").write_text("{}")
    _checkpoint(
        s,
        {
            "uid-1": {
                "state": "completed",
                "namespace": "ns",
                "name": "c1",
                "devices": [{"deviceName": mig_name}],
            }
        },
    )
    facts = NodeFacts(s)
    (r,) = check_prepared_claims(facts)
    assert r.status is Status.OK, r.detail
    _checkpoint(
        s,
        {
            "uid-1": {
                "state": "completed",
                "namespace": "ns",
                "name": "c1",
                "devices": [{"deviceName": "gone-mig"}],
            },
            "uid-2": {"state": "completed", "namespace": "ns", "name": "c2", "devices": []},
        },
    )
    (r,) = check_prepared_claims(facts)
    assert r.status is Status.FAIL
    assert "ns/c1: devices no longer on the node: gone-mig" in r.detail and "ns/c2: CDI spec" in r.detail


def test_a_crashing_check_is_a_fail_not_a_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dra_gpu.doctor.node_checks as nc

    def boom(_path: os.PathLike[str]) -> None:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(nc, "read_containerd_cdi", boom)
    s = settings(tmp_path)
    s.containerd_config.write_text("version = 3\n")
    results = {r.check: r for r in run_node_checks(s)}
    r = results["node/containerd-cdi"]
    assert r.status is Status.FAIL and "RuntimeError: disk on fire" in r.detail
    assert results["node/nvml"].status is Status.OK  # the others still ran


def test_nvidia_uvm_not_loaded_is_shown_with_the_host_side_fix(tmp_path: Path) -> None:
    """A container cannot load nvidia-uvm: doctor names the module and how to load it on the host;
    the host's /dev/nvidia-uvm itself is not needed (the specs carry it by number)."""
    s = settings(tmp_path)
    create_simulated(discover_node("node-a", "hgx-2x4"), s.dev_root)
    (s.dev_root / "dev/nvidia-uvm").unlink()
    facts = NodeFacts(s)
    (r,) = check_nvidia_uvm(facts)
    assert r.status is Status.OK, r.detail
    (r,) = check_device_nodes(facts)
    assert r.status is Status.OK, r.detail
    proc = s.dev_root / "proc/devices"
    proc.write_text("".join(line for line in proc.read_text().splitlines(True) if "nvidia-uvm" not in line))
    (r,) = check_nvidia_uvm(facts)
    assert r.status is Status.FAIL and "nvidia-uvm kernel module is not loaded" in r.detail
    assert "`modprobe nvidia-uvm`" in r.fix and "container cannot load" in r.fix


def test_nvml_refusing_another_drivers_kernel_module_names_both_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVML's init answered LIB_RM_VERSION_MISMATCH (the libraries upgraded on disk, the old module
    still loaded): both checks fail naming the libraries' and the kernel module's versions."""
    from dra_gpu.discovery.driver_versions import version_mismatch
    from dra_gpu.doctor import node_checks as nc

    s = settings(tmp_path)
    version_file = s.dev_root / "proc/driver/nvidia/version"
    version_file.parent.mkdir(parents=True)
    version_file.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  565.57.01  Thu Oct 10 2024\n")
    library = s.driver_root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.570.133.20"

    def refused(_settings: NodeSettings) -> object:
        raise version_mismatch(library, s.driver_root, s.dev_root)

    monkeypatch.setattr(nc, "node_inventory", refused)
    facts = NodeFacts(s)
    (nvml,) = check_nvml(facts)
    assert nvml.status is Status.FAIL and "driver version mismatch" in nvml.detail, nvml
    assert "570.133.20" in nvml.detail and "565.57.01" in nvml.detail
    assert "reboot" in nvml.fix and "--driver-root" in nvml.fix
    (drv,) = check_driver(facts)
    assert drv.status is Status.FAIL, drv
    assert "kernel module 565.57.01" in drv.detail and "570.133.20" in drv.detail
