"""The driver's wheel (what `pip install dra-gpu` and deploy/Dockerfile install) holds the driver only,
and the simulator is a distribution of its own that dra-gpu finds through its entry point.

Each wheel is built as the Dockerfile builds it (`pip wheel --no-deps --no-build-isolation`), from a
copy of its sources, so nothing an earlier build left in the checkout can slip in.
"""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from .conftest import ROOT

DRIVER_SOURCES = ("pyproject.toml", "setup.py", "README.md", "protos", "dra_gpu")  # as deploy/Dockerfile
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "_proto", "*.egg-info", "build")


def _wheel(sources: Path, out: Path) -> zipfile.ZipFile:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(sources),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


def _entry_points(wheel: zipfile.ZipFile) -> configparser.ConfigParser:
    parser = configparser.ConfigParser()
    for name in wheel.namelist():
        if name.endswith(".dist-info/entry_points.txt"):
            parser.read_string(wheel.read(name).decode())
    return parser


def test_the_drivers_wheel_has_no_simulator(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for name in DRIVER_SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=IGNORED)
        else:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name)
    wheel = _wheel(src, tmp_path / "out")
    names = wheel.namelist()
    assert {n.split("/")[0] for n in names} == {"dra_gpu", "dra_gpu-0.1.0.dist-info"}
    assert "dra_gpu/node/profiles.py" in names and "dra_gpu/cli.py" in names
    assert any(n.endswith("_pb2.py") for n in names), "the gRPC stubs are generated into the wheel"
    simulator = [n for n in names if "simnode" in n or n.endswith((".c", ".h")) or "/profiles/" in n]
    assert simulator == []
    assert not _entry_points(wheel).has_section("dra_gpu.node_profiles")


def test_the_simulator_is_its_own_distribution(tmp_path: Path) -> None:
    src = tmp_path / "sim"
    shutil.copytree(ROOT / "sim", src, ignore=IGNORED)
    wheel = _wheel(src, tmp_path / "out")
    names = wheel.namelist()
    assert {n.split("/")[0] for n in names} == {"simnode", "dra_gpu_simnode-0.1.0.dist-info"}
    # Its C library's sources and the built-in profiles travel with it (built on first use).
    assert "simnode/src/libnvidia-ml.c" in names and "simnode/profiles/hgx-2x4.yaml" in names
    points = _entry_points(wheel)
    assert dict(points["dra_gpu.node_profiles"]) == {"simulated": "simnode.provider:SimulatedProfiles"}
