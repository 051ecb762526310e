"""One version everywhere it is written: the package, the build_info metric's source, the
distribution and the chart."""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml

import dra_gpu
from dra_gpu.common.version import VERSION

ROOT = Path(__file__).resolve().parents[1]


def test_the_version_is_written_once_in_each_place_and_the_same() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((ROOT / "deploy" / "helm" / "dra-gpu" / "Chart.yaml").read_text())
    assert dra_gpu.__version__ == VERSION == pyproject == chart["appVersion"]
