"""The node checks are pure functions of what discovery found: in-process tests of many profiles
serve it from the Python fake (one simulated libnvidia-ml per process would allow one profile).
`dra-gpu doctor` through the simulated C library: test_report_and_command.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from simnode.fake import discover_node

from dra_gpu.doctor import node_checks
from dra_gpu.doctor.settings import NodeCheckSettings as NodeSettings
from dra_gpu.model.inventory import Inventory


@pytest.fixture(autouse=True)
def fake_nvml_for_profiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    real = node_checks.node_inventory

    def inventory(settings: NodeSettings) -> tuple[Inventory, Path]:
        if settings.profile is None:
            return real(settings)
        return discover_node(settings.node_name, settings.profile), settings.driver_root or Path("/")

    monkeypatch.setattr(node_checks, "node_inventory", inventory)
    yield
