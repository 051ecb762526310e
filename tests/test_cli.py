"""`dra-gpu inventory`, run as a user would: a real subprocess of the installed console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import DATA

from tests.simnode_support import needs_root, needs_toolchain, nvml_h  # noqa: F401 - a fixture

# A simulated node runs its simulated driver's libnvidia-ml.so.1 (compiled on first use, device
# nodes made with mknod).
pytestmark = [needs_toolchain, needs_root, pytest.mark.usefixtures("nvml_h")]

DRA_GPU = shutil.which("dra-gpu") or str(Path(sys.executable).with_name("dra-gpu"))


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [DRA_GPU, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_slices_yaml_is_applyable_multi_document() -> None:
    out = run("inventory", "--profile", "hgx-2x4", "--node-name", "node-a", "--slices", "-o", "yaml")
    assert out.returncode == 0, out.stderr
    docs = list(yaml.safe_load_all(out.stdout))
    assert len(docs) == 1
    assert docs[0]["apiVersion"] == "resource.k8s.io/v1" and docs[0]["kind"] == "ResourceSlice"
    assert "&id" not in out.stdout  # no YAML anchors
    devices = docs[0]["spec"]["devices"]
    domains = [d["attributes"]["nvlinkDomain"]["string"] for d in devices]
    assert len(set(domains[:4])) == 1 and len(set(domains[4:])) == 1 and domains[0] != domains[4]


def test_table_shows_devices_matrix_and_domains() -> None:
    out = run("inventory", "--profile", "hgx-2x4", "--node-name", "node-a")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("gpu-0000-18-00-0") and "NVIDIA H100 80GB HBM3" in line for line in lines)
    row0 = next(line for line in lines if line.startswith("GPU0 "))
    assert row0.split()[1:9] == ["X", "NV6", "NV6", "NV6", "SYS", "SYS", "SYS", "SYS"]
    assert "node-a.0000-18-00-0: 4 GPUs [0,1,2,3]" in out.stdout
    assert "node-a.0000-9a-00-0: 4 GPUs [4,5,6,7]" in out.stdout


def test_table_shows_pcie_distance_without_nvlink() -> None:
    pairs = run("inventory", "--profile", "pcie-pairs", "--node-name", "n").stdout.splitlines()
    row0 = next(line for line in pairs if line.startswith("GPU0 "))
    assert row0.split()[1:5] == ["X", "NV12", "SYS", "SYS"]  # GPUs 2-3 sit on the other socket
    mixed = run("inventory", "--profile", "mixed", "--node-name", "n").stdout.splitlines()
    row0 = next(line for line in mixed if line.startswith("GPU0 "))
    assert row0.split()[1:5] == ["X", "NODE", "SYS", "SYS"]


def test_json_output_and_node_name_from_environment() -> None:
    out = run("inventory", "--profile", "dgx-a100-mig", "-o", "json", env={"NODE_NAME": "gpu-7"})
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["nodeName"] == "gpu-7" and len(data["gpus"]) == 8
    mig = data["gpus"][0]["migDevices"][0]
    assert mig["profile"] == "3g.40gb" and mig["deviceName"] == "gpu-0000-07-00-0-mig-3g40gb-0"


def test_profile_from_a_file_path() -> None:
    out = run("inventory", "--profile", str(DATA / "h200.yaml"), "--node-name", "h", "-o", "json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["gpus"][0]["productName"] == "NVIDIA H200"


def test_no_nvml_and_no_profile_says_how_to_simulate() -> None:
    out = run("inventory", "--driver-root", "/nonexistent")  # no NVML there, on any machine
    assert out.returncode == 2
    assert "NVML is not available" in out.stderr and "--profile" in out.stderr
    assert "Traceback" not in out.stderr


def test_user_mistakes_exit_2_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "node.yaml"
    bad.write_text("name: x\ndriverVersion: '570.1.2'\ncudaDriverVersion: 12080\ngpus: [{index: 0}]\n")
    for args in (
        ["inventory", "--profile", "no-such-profile"],
        ["inventory", "--profile", str(bad)],
        ["inventory", "--profile", "hgx-2x4", "-o", "xml"],
        ["frobnicate"],
    ):
        out = run(*args)
        assert out.returncode == 2, args
        assert "Traceback" not in out.stderr
    out = run("inventory", "--profile", str(bad))
    assert f"{bad}: GPU 0: field 'uuid' is required" in out.stderr


def test_inventory_shows_the_driver_installation() -> None:
    from simnode.builder import default_cache_dir, ensure_driver_root

    # Without --driver-root: the profile's simulated driver, whose NVML answered.
    data = json.loads(run("inventory", "--profile", "hgx-2x4", "-o", "json").stdout)
    inst = data["driverInstallation"]
    assert inst["version"] == "570.133.20" and inst["libraries"] == 9 and inst["error"] is None
    assert Path(inst["root"]) == ensure_driver_root(default_cache_dir(), "hgx-2x4")
    # A given driver root: its libnvidia-ml.so.1 is the one loaded; files an older driver left
    # behind are shown with their version.
    root = ensure_driver_root(default_cache_dir(), "hgx-2x4", stale_version="550.54.15")
    table = run("inventory", "--profile", "hgx-2x4", "--node-name", "n", "--driver-root", str(root))
    assert table.returncode == 0, table.stderr
    line = next(x for x in table.stdout.splitlines() if x.startswith("Driver installation"))
    assert f"(root {root}): version 570.133.20, 9 libraries, 5 binaries, 2 firmware files" in line
    assert "other versions present: 550.54.15" in table.stdout
    assert "missing (optional): libnvidia-nscq.so.570.133.20" in table.stdout


def test_a_driver_root_without_nvml_is_named(tmp_path: Path) -> None:
    from tests.driver_root import make_root

    # NVML is the driver root's own libnvidia-ml.so.1, on a simulated node too.
    root = make_root(tmp_path / "driver", "570.133.20")  # stub libraries: no NVML functions
    (root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1").unlink()
    out = run("inventory", "--profile", "hgx-2x4", "--driver-root", str(root))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"no libnvidia-ml.so.1 under the driver root {root}" in out.stderr


def test_version_names_the_installed_package() -> None:
    from importlib.metadata import version

    r = run("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"dra-gpu {version('dra-gpu')}"


def test_node_commands_read_the_same_paths_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # doctor and health inspect what a running plugin made: with the DaemonSet's environment they
    # must look in the same places as kubelet-plugin.
    from dra_gpu.cli import _parser

    environment = {
        "NODE_NAME": "node-a",
        "DRIVER_NAME": "gpu.example.com",
        "DRA_GPU_PROFILE": "hgx-2x4",
        "DRA_GPU_PLUGIN_DIR": "/x/plugin",
        "DRA_GPU_REGISTRY_DIR": "/x/registry",
        "DRA_GPU_CDI_DIR": "/x/cdi",
        "DRA_GPU_DEV_ROOT": "/x/dev-root",
        "NVIDIA_DRIVER_ROOT": "/x/driver",
    }
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    parser = _parser()
    plugin = vars(parser.parse_args(["kubelet-plugin"]))
    doctor = vars(parser.parse_args(["doctor"]))
    health = vars(parser.parse_args(["health", "status"]))
    flags = ("node_name", "driver_name", "profile", "plugin_dir", "registry_dir", "cdi_dir", "dev_root")
    assert {f: plugin[f] for f in flags} == {f: doctor[f] for f in flags}
    assert plugin["driver_root"] == doctor["driver_root"] == "/x/driver"
    assert plugin["plugin_dir"] == health["plugin_dir"] == "/x/plugin"
    assert plugin["driver_name"] == health["driver_name"] == "gpu.example.com"


def test_nvml_probe_of_a_simulated_node_runs_its_simulated_driver() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "dra_gpu.node.nvml_probe", "--profile", "dgx-h100-mig"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "nvmlDeviceGetCount = 8" in out.stdout
    # As real NVML answers: nvmlDeviceGetAttributes is for MIG device handles only.
    assert "[0] nvmlDeviceGetAttributes ! NVMLError_NotSupported" in out.stdout


def test_a_driver_memory_limits_setting_from_the_environment_is_checked_like_the_flag() -> None:
    bad = run("kubelet-plugin", "--node-name", "n", env={"DRA_GPU_DRIVER_MEMORY_LIMITS": "always"})
    assert bad.returncode == 2
    assert "$DRA_GPU_DRIVER_MEMORY_LIMITS): 'always' is not auto or off" in bad.stderr
    flag = run("kubelet-plugin", "--node-name", "n", "--driver-memory-limits", "always")
    assert flag.returncode == 2 and "invalid choice: 'always'" in flag.stderr
