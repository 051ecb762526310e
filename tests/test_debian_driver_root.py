"""e2e/node/debian_driver_root.py without the network: a stand-in mmdebstrap writes a dpkg database.

Checks the cache (one build per input hash, built beside the target and renamed into place, a
`.complete` marker, older roots of the suite removed), the manifest of installed versions (read
with the real dpkg-query), and the clear failure when the archive carries another driver version.
The real roots are built by tests/test_nvml_symbols.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import sys
from pathlib import Path
from types import ModuleType

import pytest

BUILDER = Path(__file__).resolve().parents[1] / "e2e" / "node" / "debian_driver_root.py"

pytestmark = pytest.mark.skipif(shutil.which("dpkg-query") is None, reason="needs dpkg-query")

FAKE_MMDEBSTRAP = """#!{python}
import os, sys
if sys.argv[1:] == ["--version"]:
    sys.exit(print("mmdebstrap 0.0-stand-in"))
open(os.environ["FAKE_MMDEBSTRAP_CALLS"], "a").write(" ".join(sys.argv[1:]) + "\\n")
suite, dest, mirror = sys.argv[-3:]
version = os.environ["FAKE_NVIDIA_VERSION"]
include = next(a for a in sys.argv if a.startswith("--include=")).split("=", 1)[1].split(",")
os.makedirs(os.path.join(dest, "var/lib/dpkg"), exist_ok=True)
entries = []
for pkg in include + ["nvidia-alternative", "libc6"]:
    if pkg == "nvidia-persistenced":
        src, ver = "nvidia-persistenced", "535.171.04-1~deb12u1"
    elif pkg == "libc6":
        src, ver = "glibc", "2.36-9+deb12u13"
    else:
        src, ver = "nvidia-graphics-drivers", version + "-1"
    entries.append(f"Package: {{pkg}}\\nStatus: install ok installed\\nArchitecture: amd64\\n"
                   f"Source: {{src}}\\nVersion: {{ver}}\\n")
open(os.path.join(dest, "var/lib/dpkg/status"), "w").write("\\n".join(entries))
lib = os.path.join(dest, "usr/lib/x86_64-linux-gnu/nvidia/current")
os.makedirs(lib, exist_ok=True)
open(os.path.join(lib, "libnvidia-ml.so." + version), "wb").write(b"\\x7fELF")
"""


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("e2e_debian_driver_root", BUILDER)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def builder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "mmdebstrap"
    fake.write_text(FAKE_MMDEBSTRAP.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MMDEBSTRAP_CALLS", str(tmp_path / "calls"))
    monkeypatch.setenv("FAKE_NVIDIA_VERSION", "535.261.03")
    monkeypatch.setenv("DRA_GPU_CACHE", str(tmp_path / "cache"))
    mod = _load()
    monkeypatch.setattr(mod.os, "geteuid", lambda: 0)
    return mod


def _calls(tmp_path: Path) -> list[str]:
    path = tmp_path / "calls"
    return path.read_text().splitlines() if path.exists() else []


def test_builds_once_and_records_versions(builder: ModuleType, tmp_path: Path) -> None:
    root = builder.driver_root("bookworm")
    base = tmp_path / "cache" / "debian-driver-roots"
    assert root.parent == base and root.name == f"bookworm-{builder.cache_key(builder.SUITES['bookworm'])}"
    assert (root / ".complete").is_file()
    manifest = json.loads((root / ".dra-gpu-driver-root.json").read_text())
    assert manifest["driverVersion"] == "535.261.03"
    assert manifest["mmdebstrap"] == "mmdebstrap 0.0-stand-in"
    assert manifest["packages"]["libnvidia-ml1"] == {
        "version": "535.261.03-1",
        "source": "nvidia-graphics-drivers",
    }
    assert manifest["packages"]["nvidia-persistenced"]["version"] == "535.171.04-1~deb12u1"
    assert manifest["nvml"] == "usr/lib/x86_64-linux-gnu/nvidia/current/libnvidia-ml.so.535.261.03"
    (call,) = _calls(tmp_path)
    assert "--components=main,contrib,non-free,non-free-firmware" in call
    assert "--variant=essential" in call and "nvidia-cuda-mps" in call and "firmware-nvidia-gsp" in call
    # cached: no second build, by suite name or by driver version; nothing temporary left beside it
    assert builder.driver_root("535.261.03") == root
    assert builder.cached_driver_root("bookworm") == root
    assert len(_calls(tmp_path)) == 1
    assert sorted(p.name for p in base.iterdir() if not p.name.endswith(".lock")) == [root.name]


def test_wrong_driver_version_fails_clearly(
    builder: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_NVIDIA_VERSION", "535.274.02")  # the archive moved on
    with pytest.raises(builder.DriverRootError) as err:
        builder.driver_root("bookworm")
    msg = str(err.value)
    assert "535.261.03" in msg and "libnvidia-ml1 535.274.02-1" in msg
    base = tmp_path / "cache" / "debian-driver-roots"
    assert [p.name for p in base.iterdir() if not p.name.endswith(".lock")] == []
    assert builder.cached_driver_root("bookworm") is None


def test_new_inputs_replace_the_suites_old_root(builder: ModuleType, tmp_path: Path) -> None:
    base = tmp_path / "cache" / "debian-driver-roots"
    stale = base / "bookworm-0123456789abcdef"
    (stale / "usr").mkdir(parents=True)
    (stale / ".complete").write_text("")
    other = base / "trixie-0123456789abcdef"
    other.mkdir()
    root = builder.driver_root("bookworm")
    assert root.is_dir() and not stale.exists() and other.is_dir()


def test_cli_prints_the_root(builder: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    assert builder.main(["bookworm"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert (path / ".complete").is_file()
    assert builder.main(["sid"]) == 1
    assert "unknown suite or driver version 'sid'" in capsys.readouterr().err


def test_key_follows_the_inputs(builder: ModuleType) -> None:
    bookworm, trixie = builder.SUITES["bookworm"], builder.SUITES["trixie"]
    assert builder.cache_key(bookworm) != builder.cache_key(trixie)
    assert builder.upstream_version("1:535.261.03-1~deb12u1") == "535.261.03"
