"""One NodeSettings for every node command: the same flags and environment resolve to the same
node, paths and defaults in `kubelet-plugin`, `doctor`, `health` and `inventory`."""

from __future__ import annotations

from pathlib import Path

import pytest
from simnode.builder import default_cache_dir

from dra_gpu.cli import _parser
from dra_gpu.node.settings import NodeSettings

COMMANDS = {
    "kubelet-plugin": ["kubelet-plugin"],
    "doctor": ["doctor"],
    "health": ["health", "status"],
}


def settings(argv: list[str]) -> NodeSettings:
    return NodeSettings.from_args(_parser().parse_args(argv))


@pytest.fixture(autouse=True)
def _no_node_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("NODE_NAME", "DRIVER_NAME", "DRA_GPU_PROFILE", "DRA_GPU_PLUGIN_DIR", "DRA_GPU_DEV_ROOT"):
        monkeypatch.delenv(var, raising=False)
    for var in ("NVIDIA_DRIVER_ROOT", "DRA_GPU_REGISTRY_DIR", "DRA_GPU_CDI_DIR", "NVIDIA_HOST_DRIVER_ROOT"):
        monkeypatch.delenv(var, raising=False)


def test_defaults_are_resolved_once_and_alike() -> None:
    resolved = {name: settings(argv) for name, argv in COMMANDS.items()}
    for s in resolved.values():
        assert s.plugin_dir == Path("/var/lib/kubelet/plugins/gpu.dra-gpu.io")
        assert (s.dev_root, s.driver_root) == (Path("/"), Path("/"))
        assert s.registry_dir == Path("/var/lib/kubelet/plugins_registry")
        assert s.cdi_dir == Path("/var/run/cdi")
    assert len({(s.node_name, s.plugin_dir, s.dev_root) for s in resolved.values()}) == 1
    inventory = settings(["inventory"])
    assert (inventory.driver_root, inventory.node_name) == (Path("/"), resolved["doctor"].node_name)


def test_a_simulated_node_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NODE_NAME", "node-b")
    monkeypatch.setenv("DRIVER_NAME", "gpu.example.com")
    monkeypatch.setenv("DRA_GPU_PROFILE", "hgx-2x4")
    monkeypatch.setenv("DRA_GPU_PLUGIN_DIR", str(tmp_path / "plugin"))
    monkeypatch.setenv("DRA_GPU_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("kubelet-plugin", "doctor"):
        s = settings(COMMANDS[name])
        assert (s.node_name, s.driver, s.profile) == ("node-b", "gpu.example.com", "hgx-2x4")
        assert s.dev_root == tmp_path / "plugin" / "simulated-root"
        # The profile's package builds its driver root on first use, in its own cache dir.
        assert s.driver_root is None and s.cache_dir is None
        assert s.registration_socket == Path("/var/lib/kubelet/plugins_registry/gpu.example.com-reg.sock")
    assert settings(COMMANDS["health"]).plugin_dir == tmp_path / "plugin"
    assert default_cache_dir() == tmp_path / "cache"


def test_the_plugins_own_options() -> None:
    s = settings(
        ["kubelet-plugin", "--dynamic-mig", "--memory-shares", "--host-driver-root", "/run/nvidia/driver"]
    )
    assert (s.dynamic_mig, s.memory_shares, s.host_driver_root) == (True, True, "/run/nvidia/driver")
    assert settings(["inventory", "--dynamic-mig"]).dynamic_mig
