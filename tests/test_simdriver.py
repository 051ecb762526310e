"""The simulated driver root (sim/simnode, through its CLI e2e/node/simdriver/build.py): real ELF
files, sonames, and what they report.

The device nodes are real character devices made with mknod in a temporary directory that the
simulated libraries are pointed at with DRA_GPU_SIM_DEV_DIR (simulation only).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.simnode_support import nvml_h  # noqa: F401 - fixture

REPO = Path(__file__).resolve().parents[1]
BUILDER = REPO / "e2e" / "node" / "simdriver" / "build.py"
VERSION = "570.133.20"
STALE = "550.54.15"
SMI_FAILED = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None or shutil.which("readelf") is None,
    reason="no C toolchain (cc, readelf): the simulated driver is compiled from C (apt-get install gcc)",
)


def _load_builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("simdriver_build", BUILDER)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the body runs
    spec.loader.exec_module(mod)
    return mod


sd = _load_builder()


@pytest.fixture(autouse=True)
def _nvml_header(nvml_h: Path) -> None:  # noqa: F811
    """Every build compiles libnvidia-ml against NVIDIA's nvml.h, fetched once per session."""


def _gpus() -> list[Any]:
    return [
        sd.SimGpu(
            m,
            f"GPU-{m:08x}-0000-4000-8000-{m:012x}",
            "NVIDIA H100 80GB HBM3",
            f"0000:{0x18 + m:02x}:00.0",
            81559,
        )
        for m in range(8)
    ]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("simdriver") / "root"
    return Path(sd.build_driver_root(dest, VERSION, _gpus(), cuda_version=12080))


@pytest.fixture
def libdir(root: Path) -> Path:
    return Path(sd.lib_dir(root))


@pytest.fixture
def devdir(tmp_path: Path) -> Iterator[Path]:
    """A dev dir with nvidiactl and the nodes of GPUs 2 and 5, plus decoys that must not count."""
    if os.geteuid() != 0:
        pytest.skip("mknod of character devices needs root")
    dev = tmp_path / "dev"
    dev.mkdir()
    os.mknod(dev / "nvidiactl", 0o666 | 0o020000, os.makedev(195, 255))
    for minor in (2, 5):
        os.mknod(dev / f"nvidia{minor}", 0o666 | 0o020000, os.makedev(195, minor))
    os.mknod(dev / "nvidia3", 0o666 | 0o020000, os.makedev(195, 4))  # wrong minor
    os.mknod(dev / "nvidia6", 0o666 | 0o020000, os.makedev(1, 6))  # wrong major
    (dev / "nvidia7").write_text("")  # not a device
    yield dev


def _soname(path: Path) -> str | None:
    out = subprocess.run(["readelf", "-d", str(path)], check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        if "(SONAME)" in line:
            return line.split("[", 1)[1].rstrip("]")
    return None


def _needed(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], check=True, capture_output=True, text=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def _smi(root: Path, *args: str, dev: Path | None, libs: Path | None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin"}
    if dev is not None:
        env["DRA_GPU_SIM_DEV_DIR"] = str(dev)
    if libs is not None:
        env["LD_LIBRARY_PATH"] = str(libs)
    return subprocess.run(
        [str(root / "usr/bin/nvidia-smi"), *args], env=env, capture_output=True, text=True, timeout=30
    )


def test_libraries_have_real_names_sonames_and_links(libdir: Path) -> None:
    assert libdir.name == sd.multiarch()
    for lib in sd.LIBRARIES:
        real = libdir / f"{lib.stem}.{VERSION}"
        assert real.is_file() and not real.is_symlink(), real
        assert real.read_bytes()[:4] == b"\x7fELF"
        assert _soname(real) == (lib.soname or real.name)
        if lib.soname is not None:
            assert os.readlink(libdir / lib.soname) == real.name
    assert not (libdir / "libnvidia-gpucomp.so.1").exists()
    assert os.readlink(libdir / "libcuda.so") == "libcuda.so.1"
    assert os.readlink(libdir / "libnvidia-ml.so") == "libnvidia-ml.so.1"


def test_binaries_and_firmware(root: Path) -> None:
    for name in ("nvidia-smi", *sd.TOOLS):
        prog = root / "usr/bin" / name
        assert prog.read_bytes()[:4] == b"\x7fELF" and os.access(prog, os.X_OK), prog
    assert "libnvidia-ml.so.1" in _needed(root / "usr/bin/nvidia-smi")
    tool = subprocess.run([str(root / "usr/bin/nvidia-persistenced")], capture_output=True, text=True)
    assert tool.returncode == 0 and VERSION in tool.stdout
    for fw in ("gsp_ga10x.bin", "gsp_tu10x.bin"):
        assert (root / "lib/firmware/nvidia" / VERSION / fw).stat().st_size > 0


def test_libcuda_loads_and_reports_versions_and_devices(
    libdir: Path, devdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cuda = ctypes.CDLL(str(libdir / "libcuda.so.1"))
    version = ctypes.c_int()
    assert cuda.cuDriverGetVersion(ctypes.byref(version)) == 0
    assert version.value == 12080
    monkeypatch.setenv("DRA_GPU_SIM_DEV_DIR", str(devdir / "missing"))
    assert cuda.cuInit(0) == 100  # CUDA_ERROR_NO_DEVICE
    monkeypatch.setenv("DRA_GPU_SIM_DEV_DIR", str(devdir))
    assert cuda.cuInit(0) == 0
    count, dev = ctypes.c_int(), ctypes.c_int()
    assert cuda.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value == 2
    assert cuda.cuDeviceGet(ctypes.byref(dev), 1) == 0
    name = ctypes.create_string_buffer(96)
    assert cuda.cuDeviceGetName(name, 96, dev) == 0
    assert name.value == b"NVIDIA H100 80GB HBM3"
    assert cuda.cuDeviceGet(ctypes.byref(dev), 2) == 101  # CUDA_ERROR_INVALID_DEVICE


def test_nvidia_smi_lists_exactly_the_gpus_whose_nodes_exist(root: Path, libdir: Path, devdir: Path) -> None:
    out = _smi(root, "-L", dev=devdir, libs=libdir)
    assert out.returncode == 0, out.stderr
    uuids = {g.minor: g.uuid for g in _gpus()}
    assert out.stdout.splitlines() == [
        f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {uuids[2]})",
        f"GPU 1: NVIDIA H100 80GB HBM3 (UUID: {uuids[5]})",
    ]


def test_nvidia_smi_query_gpu_csv(root: Path, libdir: Path, devdir: Path) -> None:
    fields = "uuid,name,memory.total,driver_version,pci.bus_id"
    out = _smi(root, f"--query-gpu={fields}", "--format=csv,noheader", dev=devdir, libs=libdir)
    assert out.returncode == 0, out.stderr
    uuid2 = _gpus()[2].uuid
    assert (
        out.stdout.splitlines()[0]
        == f"{uuid2}, NVIDIA H100 80GB HBM3, 81559 MiB, {VERSION}, 00000000:1A:00.0"
    )
    with_header = _smi(
        root, "--query-gpu=index,memory.total", "--format=csv,nounits", dev=devdir, libs=libdir
    )
    assert with_header.stdout.splitlines() == ["index, memory.total [MiB]", "0, 81559", "1, 81559"]
    bad = _smi(root, "--query-gpu=uuid,bogus", "--format=csv", dev=devdir / "none", libs=libdir)
    assert bad.returncode == 2 and 'Field "bogus" is not a valid field to query.' in bad.stdout


def test_nvidia_smi_table(root: Path, libdir: Path, devdir: Path) -> None:
    out = _smi(root, dev=devdir, libs=libdir)
    assert out.returncode == 0, out.stderr
    assert f"Driver Version: {VERSION}" in out.stdout and "CUDA Version: 12.8" in out.stdout
    assert sum("NVIDIA H100 80GB HBM3" in line for line in out.stdout.splitlines()) == 2


def test_nvidia_smi_without_nvidiactl_fails_like_the_real_one(root: Path, libdir: Path, devdir: Path) -> None:
    (devdir / "nvidiactl").unlink()
    out = _smi(root, "-L", dev=devdir, libs=libdir)
    assert out.returncode == 9
    assert SMI_FAILED in out.stdout


def test_nvidia_smi_with_no_gpu_node(root: Path, libdir: Path, devdir: Path) -> None:
    for minor in (2, 5):
        (devdir / f"nvidia{minor}").unlink()
    out = _smi(root, "-L", dev=devdir, libs=libdir)
    assert (out.returncode, out.stdout.strip()) == (6, "No devices found.")


def test_nvidia_smi_cannot_start_without_the_library(root: Path, devdir: Path) -> None:
    out = _smi(root, "-L", dev=devdir, libs=None)
    assert out.returncode == 127
    assert "libnvidia-ml.so.1: cannot open shared object file" in out.stderr


def test_pynvml_works_against_the_simulated_library(libdir: Path, devdir: Path) -> None:
    # In a subprocess: loading libnvidia-ml.so.1 here would hand it to every later pynvml user.
    script = (
        "import pynvml as n\n"
        "n.nvmlInit()\n"
        "h = n.nvmlDeviceGetHandleByIndex(1)\n"
        "print(n.nvmlSystemGetDriverVersion(), n.nvmlDeviceGetCount(), n.nvmlDeviceGetMinorNumber(h),\n"
        "      n.nvmlDeviceGetUUID(h), n.nvmlDeviceGetPciInfo(h).busId, n.nvmlDeviceGetMemoryInfo(h).total)\n"
    )
    env = {"LD_LIBRARY_PATH": str(libdir), "DRA_GPU_SIM_DEV_DIR": str(devdir)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [VERSION, "2", "5", _gpus()[5].uuid, "00000000:1D:00.0", str(81559 << 20)]


def test_stale_version_leaves_libcuda_so_pointing_at_the_old_driver(tmp_path: Path) -> None:
    root = sd.build_driver_root(tmp_path / "root", VERSION, _gpus(), stale_version=STALE)
    libdir = sd.lib_dir(root)
    for stem in ("libcuda.so", "libnvidia-ml.so"):
        assert (libdir / f"{stem}.{STALE}").is_file()
        assert (libdir / f"{stem}.{VERSION}").is_file()
        assert _soname(libdir / f"{stem}.{STALE}") == f"{stem}.1"
    assert os.readlink(libdir / "libcuda.so") == f"libcuda.so.{STALE}"
    assert os.readlink(libdir / "libcuda.so.1") == f"libcuda.so.{VERSION}"
    assert os.readlink(libdir / "libnvidia-ml.so.1") == f"libnvidia-ml.so.{VERSION}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]  # no temp dirs left behind


def test_build_replaces_an_existing_root_and_rejects_bad_input(tmp_path: Path) -> None:
    dest = tmp_path / "root"
    sd.build_driver_root(dest, "550.54.15", _gpus()[:1])
    sd.build_driver_root(dest, VERSION, _gpus()[:1])
    assert not (sd.lib_dir(dest) / "libcuda.so.550.54.15").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]
    with pytest.raises(sd.SimDriverError, match="not a driver version"):
        sd.build_driver_root(tmp_path / "x", "570; rm", _gpus())
    with pytest.raises(sd.SimDriverError, match="pci_bus_id"):
        sd.build_driver_root(tmp_path / "x", VERSION, [sd.SimGpu(0, "GPU-x", "n", "18:00.0", 1)])
    assert not (tmp_path / "x").exists()


def test_ensure_driver_root_builds_once_per_key(tmp_path: Path) -> None:
    first = sd.ensure_driver_root(tmp_path, "dgx-h100")
    assert first.parent == tmp_path / "simdriver"
    inode = first.stat().st_ino
    assert sd.ensure_driver_root(tmp_path, "dgx-h100") == first
    assert first.stat().st_ino == inode  # reused, not rebuilt
    other = sd.ensure_driver_root(tmp_path, "dgx-h100", version="570.172.08")
    assert other != first
    assert (sd.lib_dir(other) / "libcuda.so.570.172.08").is_file()
    # The profile's driverVersion is the default.
    assert (sd.lib_dir(first) / "libcuda.so.570.133.20").is_file()


def test_cli_builds_a_profile(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(BUILDER), "--profile", "dgx-h100", "--out", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "r")
    assert (sd.lib_dir(tmp_path / "r") / "libnvidia-ml.so.570.133.20").is_file()


def test_a_cached_root_that_appears_meanwhile_is_kept(tmp_path: Path, nvml_h: Path) -> None:  # noqa: F811
    # As when another process renames the same root into place while this one compiles.
    dest = tmp_path / "key"
    dest.mkdir()
    (dest / "theirs").write_text("")
    profile = sd.profile_of_gpus(_gpus(), VERSION, 12080)
    sd._build(dest, VERSION, profile, None, 12080, nvml_h, replace=False)
    assert [p.name for p in dest.iterdir()] == ["theirs"]
    assert [p.name for p in tmp_path.iterdir()] == ["key"]


def test_nvidia_smi_compute_policy_sets_and_lists_time_slices(root: Path, libdir: Path, devdir: Path) -> None:
    uuids = {g.minor: g.uuid for g in _gpus()}
    out = _smi(root, "compute-policy", "-i", uuids[5], "--set-timeslice", "3", dev=devdir, libs=libdir)
    assert out.returncode == 0 and out.stdout.strip() == f"Set timeslice to 3 for GPU {uuids[5]}.", out
    listed = _smi(root, "compute-policy", "-l", dev=devdir, libs=libdir).stdout.splitlines()
    assert listed == [f"GPU 0 ({uuids[2]}): Timeslice 0 (DEFAULT)", f"GPU 1 ({uuids[5]}): Timeslice 3 (LONG)"]
    bad = _smi(root, "compute-policy", "-i", "0", "--set-timeslice", "7", dev=devdir, libs=libdir)
    assert bad.returncode == 2 and "valid: 0-3" in bad.stdout


def test_mps_control_daemon_answers_on_its_pipe_and_quits(root: Path, tmp_path: Path) -> None:
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "p"), "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "l")}
    binary = str(root / "usr/bin/nvidia-cuda-mps-control")

    def ask(*commands: str) -> subprocess.CompletedProcess[str]:
        text = "".join(f"{c}\n" for c in commands)
        return subprocess.run([binary], input=text, env=env, capture_output=True, text=True, timeout=10)

    assert ask("get_server_list").stdout.strip() == "Cannot find MPS control daemon process"
    assert subprocess.run([binary, "-d"], env=env, timeout=10).returncode == 0
    pid = int((tmp_path / "p" / "nvidia-cuda-mps-control.pid").read_text())
    try:
        out = ask(
            "set_default_active_thread_percentage 40",
            "set_default_device_pinned_mem_limit GPU-x 8G",
            "get_default_active_thread_percentage",
            "get_default_device_pinned_mem_limit GPU-x",
            "get_default_device_pinned_mem_limit 0",
        )
        assert out.stdout.splitlines() == ["40.0", "40.0", "8G", "Not Set"]
        again = subprocess.run([binary, "-d"], env=env, capture_output=True, text=True, timeout=10)
        assert again.returncode == 1 and "already running" in again.stderr
        ask("quit")
        assert "Shutdown" in (tmp_path / "l" / "control.log").read_text()
        assert not (tmp_path / "p" / "control").exists()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_nvidia_smi_sets_a_gpus_compute_mode_as_nvidias_dra_driver_runs_it(
    root: Path, libdir: Path, devdir: Path
) -> None:
    """NVIDIA's DRA driver runs `nvidia-smi -i <uuid> -c DEFAULT` before it sets a time slice
    (and EXCLUSIVE_PROCESS for MPS): through NVML, read back by NVML."""
    uuid = _gpus()[2].uuid

    def mode() -> str:
        q = _smi(root, f"--id={uuid}", dev=devdir, libs=libdir)
        assert q.returncode == 2  # -i with nothing it narrows: refused, as before
        out = _smi(root, "--query-gpu=uuid,compute_mode", "--format=csv,noheader", dev=devdir, libs=libdir)
        return dict(line.split(", ") for line in out.stdout.splitlines())[uuid]

    out = _smi(root, "-i", uuid, "-c", "EXCLUSIVE_PROCESS", dev=devdir, libs=libdir)
    assert out.returncode == 0, out.stdout
    assert out.stdout.splitlines() == [
        "Set compute mode to EXCLUSIVE_PROCESS for GPU 00000000:1A:00.0.",
        "All done.",
    ]
    assert mode() == "Exclusive_Process"
    out = _smi(root, "-i", uuid, "-c", "DEFAULT", dev=devdir, libs=libdir)
    assert out.returncode == 0 and mode() == "Default", out.stdout
    assert _smi(root, "-i", uuid, "-c", "FAST", dev=devdir, libs=libdir).returncode == 2
    assert _smi(root, "-i", "GPU-none", "-c", "0", dev=devdir, libs=libdir).returncode == 6
