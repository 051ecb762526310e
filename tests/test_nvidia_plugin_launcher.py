"""e2e/node/nvidia_plugin.py: the launcher of NVIDIA's gpu-kubelet-plugin on a simulated node finds
the binaries where e2e/node/build.sh puts them, gives the plugin the command and environment of
docs/reference/nvidia-dra-driver-v0.5.0.md ("Measured"), and stops what it started. Run here with
a stand-in program (NVIDIA's binary is an e2e build)."""

from __future__ import annotations

import json
import os
import signal
import stat
import time
from pathlib import Path
from types import ModuleType

import pytest
from simnode.node import SimulatedNode
from simnode.profiles import load_profile

from tests.driver_root import e2e_node_script
from tests.simnode_support import needs_root, needs_toolchain, nvml_h  # noqa: F401 - a fixture


@pytest.fixture(scope="module")
def launcher() -> ModuleType:
    return e2e_node_script("nvidia_plugin")


def built(cache: Path, component: str, program: str, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    folder = cache / "bin" / component
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / program
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    (folder / ".complete").touch()
    return path


def test_the_binaries_are_where_build_sh_puts_them(
    launcher: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DRA_GPU_CACHE", str(tmp_path))
    pins = launcher.pins()
    dra, ctk = pins["NVIDIA_DRA_VERSION"], pins["NVIDIA_CTK_VERSION"]
    with pytest.raises(
        launcher.NvidiaPluginError, match=r"gpu-kubelet-plugin: not built .*build.sh nvidia-dra"
    ):
        launcher.plugin_binary()
    plugin = built(tmp_path, f"dra-driver-nvidia-gpu-{dra}", "gpu-kubelet-plugin")
    assert launcher.plugin_binary() == plugin
    hook_dir = tmp_path / "bin" / f"nvidia-container-toolkit-{ctk}"
    hook_dir.mkdir(parents=True)
    (hook_dir / "nvidia-cdi-hook").write_text("")  # no .complete: an interrupted build
    with pytest.raises(launcher.NvidiaPluginError, match=r"nvidia-cdi-hook: not built .*build.sh toolkit"):
        launcher.cdi_hook()
    hook = built(tmp_path, hook_dir.name, "nvidia-cdi-hook")
    assert launcher.cdi_hook() == hook


def node_at(root: Path, profile: str = "dgx-h100") -> SimulatedNode:
    """A node's paths only (nothing made): what the command is built from."""
    return SimulatedNode(load_profile(profile), root / "cached-driver-root", root / "node")


def test_the_command_and_environment_are_the_measured_ones(launcher: ModuleType, tmp_path: Path) -> None:
    node = node_at(tmp_path)
    p = launcher.NvidiaPlugin(
        node,
        tmp_path / "kubeconfig",
        "node-a",
        tmp_path / "plugins",
        tmp_path / "registry",
        tmp_path / "cdi",
        feature_gates=["DynamicMIG=true", "FabricManagerPartitioning=false"],
        extra_args=["--healthcheck-port", "-1"],
        binary=tmp_path / "gpu-kubelet-plugin",
        hook=tmp_path / "nvidia-cdi-hook",
    )
    argv = p.argv()
    flags = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert argv[0] == str(tmp_path / "gpu-kubelet-plugin")
    assert flags["--nvidia-driver-root"] == flags["--container-driver-root"] == str(node.driver_root_view)
    assert flags["--host-root"] == str(node.dev_root)
    assert flags["--node-name"] == "node-a" and flags["--kubeconfig"] == str(tmp_path / "kubeconfig")
    assert flags["--kubelet-plugins-directory-path"] == str(tmp_path / "plugins")
    assert flags["--kubelet-registrar-directory-path"] == str(tmp_path / "registry")
    assert flags["--cdi-root"] == str(tmp_path / "cdi")
    assert flags["--nvidia-cdi-hook-path"] == str(tmp_path / "nvidia-cdi-hook")
    assert flags["--image-name"]  # required by the plugin even without MPS
    assert flags["--feature-gates"] == "DynamicMIG=true,FabricManagerPartitioning=false"
    assert argv[-2:] == ["--healthcheck-port", "-1"]
    env = p.env({"PATH": "/usr/bin"})
    assert env == {
        "PATH": "/usr/bin",
        "DRA_GPU_SIM_DEV_DIR": str(node.dev_dir),
        "DRA_GPU_SIM_PROC_DIR": str(node.proc_dir),
        "NVIDIA_DRA_SYSFS_ROOT": str(node.sys_dir),
        "ALT_PROC_DEVICES_PATH": str(node.proc_dir / "devices"),
    }
    assert (
        launcher.gates_flag({"DynamicMIG": True, "MPSSupport": False}) == "DynamicMIG=true,MPSSupport=false"
    )
    with pytest.raises(launcher.NvidiaPluginError, match="'DynamicMIG': not Name=true"):
        launcher.gates_flag(["DynamicMIG"])


# A stand-in for the plugin: writes what it was given, then waits (or ignores SIGTERM).
STAND_IN = """#!/bin/sh
{trap}
printf '%s\\n' "$@" > "$0.argv"
env > "$0.env"
echo started
while :; do sleep 0.1; done
"""


def stand_in(tmp_path: Path, trap: str) -> Path:
    path = tmp_path / "bin" / "gpu-kubelet-plugin"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(STAND_IN.format(trap=trap))
    path.chmod(0o755)
    return path


def wait_for_file(path: Path) -> None:
    deadline = time.monotonic() + 20
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)


@pytest.mark.parametrize(("trap", "status"), [("trap 'exit 0' TERM", 0), ("trap '' TERM", -signal.SIGKILL)])
def test_it_runs_and_stops_what_it_started(
    launcher: ModuleType, tmp_path: Path, trap: str, status: int
) -> None:
    node = node_at(tmp_path)
    binary = stand_in(tmp_path, trap)
    p = launcher.NvidiaPlugin(
        node,
        tmp_path / "kubeconfig",
        "node-a",
        tmp_path / "plugins",
        tmp_path / "registry",
        tmp_path / "cdi",
        binary=binary,
        hook=tmp_path / "hook",
        log_path=tmp_path / "logs" / "plugin.log",
    )
    p.start()
    wait_for_file(Path(f"{binary}.env"))
    assert p.running and (tmp_path / "registry").is_dir()  # the registrar's socket directory
    with pytest.raises(launcher.NvidiaPluginError, match="already running"):
        p.start()
    env = dict(line.split("=", 1) for line in Path(f"{binary}.env").read_text().splitlines() if "=" in line)
    assert env["ALT_PROC_DEVICES_PATH"] == str(node.proc_dir / "devices")
    assert Path(f"{binary}.argv").read_text().splitlines() == p.argv()[1:]
    assert p.stop(term_wait=1, kill_wait=5) == status
    assert not p.running and p.returncode == status
    assert "started" in p.log()
    assert p.stop() == status  # again: nothing left to stop


@needs_toolchain
@needs_root
def test_a_profile_is_prepared_without_touching_the_callers_environment(
    launcher: ModuleType,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    nvml_h: Path,  # noqa: F811
) -> None:
    monkeypatch.setenv("DRA_GPU_SIM_DEV_DIR", "/the/callers/own")
    monkeypatch.delenv("DRA_GPU_SIM_PROC_DIR", raising=False)
    p = launcher.NvidiaPlugin.on_profile(
        "dgx-a100-mig",
        tmp_path / "node",
        tmp_path / "kubeconfig",
        "node-a",
        tmp_path / "plugins",
        tmp_path / "registry",
        tmp_path / "cdi",
        binary=tmp_path / "plugin",
        hook=tmp_path / "hook",
    )
    assert os.environ["DRA_GPU_SIM_DEV_DIR"] == "/the/callers/own"
    assert "DRA_GPU_SIM_PROC_DIR" not in os.environ
    assert p.env()["DRA_GPU_SIM_DEV_DIR"] == str(tmp_path / "node" / "dev")
    view = Path(dict(zip(p.argv()[1::2], p.argv()[2::2], strict=False))["--container-driver-root"])
    assert (view / "dev" / "nvidiactl").is_char_device()
    # A copy of the driver root (not links into it), with the same files.
    ours = sorted(
        str(f.relative_to(p.node.driver_root)) for f in p.node.driver_root.rglob("*") if f.is_file()
    )
    assert sorted(str(f.relative_to(view)) for f in (view / "usr").rglob("*") if f.is_file()) == [
        x for x in ours if x.startswith("usr/")
    ]
    assert (tmp_path / "node" / "sys" / "bus" / "pci" / "devices").is_dir()


def test_the_fake_node_is_labelled_unschedulable_and_tainted(launcher: ModuleType) -> None:
    node = json.loads(json.dumps(launcher.fake_node("node-a")))
    assert node["metadata"] == {"name": "node-a", "labels": {"dra-gpu.io/e2e-fake": "true"}}
    assert node["spec"]["unschedulable"] is True
    assert node["spec"]["taints"][0]["effect"] == "NoSchedule"
