"""Shared helpers for the unit and integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from hypothesis import settings
from simnode.fake import simulated_nvml
from simnode.profiles import parse_profile

from dra_gpu.common import failpoints
from dra_gpu.discovery import discover
from dra_gpu.model.inventory import Inventory
from e2e.harness import skips
from tests.mutation import PROFILE, reach_report

settings.load_profile(PROFILE)  # ci (fixed seed) unless HYPOTHESIS_PROFILE says otherwise

DATA = Path(__file__).parent / "data"


@pytest.fixture
def enabled_failpoints() -> Iterator[None]:
    """Failpoints obeyed in this process, as after the plugin's --enable-failpoints."""
    failpoints.enable()
    try:
        yield
    finally:
        failpoints.enable(False)


def discover_doc(doc: dict, node: str = "node-a") -> Inventory:
    """Discover a simulated node described by a profile document (a dict)."""
    profile = parse_profile(yaml.safe_dump(doc), source="test-profile.yaml")
    nvml, pcie_root = simulated_nvml(profile)
    return discover(nvml, node, pcie_root)


def gpu_uuid(i: int) -> str:
    return f"GPU-{i:08x}-0000-4000-8000-{i:012x}"


def bus(i: int) -> str:
    return f"00000000:{0x10 + i:02X}:00.0"


@pytest.fixture
def base_doc() -> dict:
    """A 4-GPU node without NVLink, to be edited by each test."""
    return {
        "name": "test",
        "driverVersion": "570.133.20",
        "cudaDriverVersion": 12080,
        "defaults": {
            "name": "NVIDIA H100 80GB HBM3",
            "brand": "nvidia",
            "architecture": "hopper",
            "computeCapability": "9.0",
            "memoryMiB": 81559,
            "nvlinkCount": 18,
        },
        "gpus": [{"index": i, "uuid": gpu_uuid(i), "pciBusId": bus(i), "numaNode": i // 2} for i in range(4)],
    }


def pytest_configure(config: pytest.Config) -> None:
    """A skip fails the run unless declared expected (e2e/harness/skips.py)."""
    skips.register(config)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """What the fuzz properties' examples reached (tests/mutation.py), when any ran."""
    lines = reach_report()
    if lines:
        terminalreporter.section(f"fuzz reach (Hypothesis profile {PROFILE})")
        for line in lines:
            terminalreporter.write_line(line)
