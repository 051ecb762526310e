"""The host-like driver root (e2e/node/host_like_root.py): NVIDIA's real 550.163.01 Debian user space and
its glibc 2.41, with only libnvidia-ml.so.550.163.01 replaced by the simulated NVML reporting that
version.

Built into a temporary cache (the Debian trixie root of e2e/node/debian_driver_root.py comes from the
user cache, built when missing: root, mmdebstrap and Debian's archive; skipped when it cannot be
had). Nothing of NVIDIA's is run or loaded here: only the simulated library, in a child process.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
from pathlib import Path

import pytest

from dra_gpu.discovery.root_paths import regular_file_in_root
from tests.driver_root import e2e_node_script
from tests.simnode_support import (
    libcache,  # noqa: F401 - fixture
    needs_root,
    needs_toolchain,
    nvml_h,  # noqa: F401 - fixture
    run_child,
)

NVML = "usr/lib/x86_64-linux-gnu/nvidia/current/libnvidia-ml.so.550.163.01"
LIBCUDA = "usr/lib/x86_64-linux-gnu/nvidia/current/libcuda.so.550.163.01"

pytestmark = [needs_toolchain, needs_root]


HOST_LIKE = e2e_node_script("host_like_root")
DEBIAN = e2e_node_script("debian_driver_root")


@pytest.fixture(scope="module")
def debian_root() -> Path:
    root = DEBIAN.cached_driver_root("trixie")
    if root is not None:
        return Path(root)
    missing = [tool for tool in ("mmdebstrap", "dpkg-query") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"the Debian trixie driver root is not cached and {' and '.join(missing)} is missing")
    if os.geteuid() != 0:
        pytest.skip("the Debian trixie driver root is not cached, and building it needs root")
    return Path(DEBIAN.driver_root("trixie"))  # a build that fails, fails the test


@pytest.fixture(scope="module")
def host_root(tmp_path_factory: pytest.TempPathFactory, debian_root: Path, libcache: Path) -> Path:  # noqa: F811
    root: Path = HOST_LIKE.host_like_root("hgx-2x4", tmp_path_factory.mktemp("host-like"), libcache)
    return root


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _dpkg_md5(root: Path, package: str, rel: str) -> str:
    """The md5sum dpkg recorded for `rel` when it installed `package` in the root."""
    info = root / "var/lib/dpkg/info"
    (sums,) = [*info.glob(f"{package}:*.md5sums"), *info.glob(f"{package}.md5sums")]
    for line in sums.read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        if name == rel:
            return digest
    raise AssertionError(f"{rel} is not in {sums}")


def test_nvidias_files_are_debians_own_but_nvml(host_root: Path, debian_root: Path) -> None:
    manifest = HOST_LIKE.manifest(host_root)
    assert manifest["driverVersion"] == "550.163.01" and manifest["profile"] == "hgx-2x4"
    # libcuda (and everything else of NVIDIA's) is the file Debian's package installed.
    assert _md5(host_root / LIBCUDA) == _dpkg_md5(host_root, "libcuda1", LIBCUDA)
    assert (host_root / LIBCUDA).stat().st_size > 10 << 20
    nvidia_smi = regular_file_in_root(host_root, "usr/bin/nvidia-smi")  # behind the alternatives
    assert nvidia_smi is not None and nvidia_smi.name == "nvidia-smi"
    rel = str(nvidia_smi.relative_to(host_root))
    assert _md5(nvidia_smi) == _dpkg_md5(host_root, "nvidia-smi", rel)
    # libnvidia-ml.so.550.163.01 is the simulated library, at Debian's path and file name.
    nvml = host_root / NVML
    assert nvml.is_file() and not nvml.is_symlink()
    assert _md5(nvml) != _dpkg_md5(host_root, "libnvidia-ml1", NVML)
    replaced = manifest["replaced"]
    assert hashlib.sha256(nvml.read_bytes()).hexdigest() == replaced["simulatedSha256"]
    assert hashlib.sha256((debian_root / NVML).read_bytes()).hexdigest() == replaced["debianSha256"]
    assert (debian_root / NVML).read_bytes() != nvml.read_bytes()  # the Debian root is untouched
    # Debian's alternatives links (absolute, /etc/alternatives/...) resolve inside the root to it.
    for link in (
        "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
        "usr/lib/x86_64-linux-gnu/nvidia/current/libnvidia-ml.so.1",
    ):
        assert regular_file_in_root(host_root, link) == nvml, link
    assert os.readlink(host_root / "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1").startswith(
        "/etc/alternatives/"
    )


def test_the_roots_own_glibc_is_2_41(host_root: Path) -> None:
    libc = regular_file_in_root(host_root, "usr/lib/x86_64-linux-gnu/libc.so.6")
    assert libc is not None
    found = re.search(rb"GNU C Library \([^)]*\) [a-z ]*version (\d+\.\d+)", libc.read_bytes())
    assert found and found.group(1) == b"2.41"
    status = (host_root / "var/lib/dpkg/status").read_text()
    libc6 = re.search(r"^Package: libc6\n(?:.+\n)*?Version: (\S+)", status, re.M)
    assert libc6 and libc6.group(1).startswith("2.41-"), libc6
    host = os.confstr("CS_GNU_LIBC_VERSION")
    assert host != "glibc 2.41", "the test host has the root's glibc: the root is not unlike the image"


def test_simulated_nvml_reports_550_loaded_by_full_path(host_root: Path, tmp_path: Path) -> None:
    devdir = HOST_LIKE.make_dev_dir(tmp_path / "dev", "hgx-2x4")
    got = run_child(
        host_root / NVML,
        devdir,
        """
        lib = ctypes.CDLL(LIB)
        assert lib.nvmlInit_v2() == 0
        buf = ctypes.create_string_buffer(96)
        assert lib.nvmlSystemGetDriverVersion(buf, 96) == 0
        cuda = ctypes.c_int()
        assert lib.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(cuda)) == 0
        count = ctypes.c_uint()
        assert lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
        lib.nvmlShutdown()
        pynvml.nvmlInit()
        out((buf.value.decode(), cuda.value, count.value, pynvml.nvmlSystemGetDriverVersion()))
        """,
    )
    assert got == ("550.163.01", 12040, 8, "550.163.01")


def test_dev_dir_has_a_node_per_gpu_of_the_profile(tmp_path: Path) -> None:
    devdir = HOST_LIKE.make_dev_dir(tmp_path / "dev", "dgx-h100-mig")
    names = sorted(p.name for p in devdir.iterdir())
    assert names == sorted(["nvidiactl", *(f"nvidia{i}" for i in range(8))])
    st = os.stat(devdir / "nvidiactl")
    assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (195, 255)


def test_cached_by_its_inputs(host_root: Path, libcache: Path) -> None:  # noqa: F811
    base = host_root.parent
    assert HOST_LIKE.host_like_root("hgx-2x4", base, libcache) == host_root  # no rebuild
    mig = HOST_LIKE.host_like_root("dgx-h100-mig", base, libcache)
    assert mig != host_root and mig.name.startswith("dgx-h100-mig-") and host_root.is_dir()
    assert HOST_LIKE.manifest(mig)["profile"] == "dgx-h100-mig"
    assert (mig / NVML).read_bytes() != (host_root / NVML).read_bytes()  # another GPU table
    assert not [p for p in base.iterdir() if p.name.startswith(".") and p.is_dir()]  # no temp dirs left


def test_bookworm_root_reports_535_and_lives_beside_the_trixie_one(
    host_root: Path,
    tmp_path: Path,
    libcache: Path,  # noqa: F811
) -> None:
    if DEBIAN.cached_driver_root("bookworm") is None and shutil.which("mmdebstrap") is None:
        pytest.skip("the Debian bookworm driver root is not cached and mmdebstrap is missing")
    base = host_root.parent
    old = HOST_LIKE.host_like_root("hgx-2x4", base, libcache, suite="bookworm")
    assert old.name.startswith("hgx-2x4-bookworm-") and host_root.is_dir()  # one does not evict the other
    assert HOST_LIKE.host_like_root("hgx-2x4", base, libcache) == host_root and old.is_dir()
    manifest = HOST_LIKE.manifest(old)
    nvml = old / "usr/lib/x86_64-linux-gnu/nvidia/current/libnvidia-ml.so.535.261.03"
    assert manifest["driverVersion"] == "535.261.03" and manifest["replaced"]["path"] == str(
        nvml.relative_to(old)
    )
    assert regular_file_in_root(old, "usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1") == nvml
    devdir = HOST_LIKE.make_dev_dir(tmp_path / "dev", "hgx-2x4")
    got = run_child(
        nvml,
        devdir,
        """
        pynvml.nvmlInit()
        out((pynvml.nvmlSystemGetDriverVersion(), pynvml.nvmlSystemGetCudaDriverVersion_v2()))
        """,
    )
    assert got == ("535.261.03", 12020)
