"""The chart's DeviceClasses as `dra-gpu validate` and `dra-gpu explain` know them
(dra_gpu.model.device_classes) are the ones Helm renders: names, selectors, extendedResourceName;
and in NVIDIA-compatible mode NVIDIA's own classes, selector for selector, as its chart has them
(docs/reference/nvidia-dra-driver-v0.5.0.md §2)."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from dra_gpu.model import nvidia_compat
from dra_gpu.model.device_classes import chart_device_classes

from .conftest import ROOT, Render, by_kind

REFERENCE = ROOT / "docs" / "reference" / "nvidia-dra-driver-v0.5.0.md"


def essentials(classes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> the fields that decide what a class selects and serves."""
    return {
        c["metadata"]["name"]: {
            "apiVersion": c["apiVersion"],
            "selectors": c["spec"].get("selectors"),
            "extendedResourceName": c["spec"].get("extendedResourceName"),
        }
        for c in classes
    }


def nvidia_selectors() -> dict[str, str]:
    """NVIDIA's chart's class -> its CEL selector, from the reference's §2 table."""
    section = REFERENCE.read_text().split("## 2. DeviceClasses", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z.-]+)` \|[^|]*\| `([^`]+)`", section, re.M)
    return dict(rows)


@pytest.mark.parametrize(
    ("sets", "driver", "gpu_extended", "mig_extended"),
    [
        ((), "gpu.dra-gpu.io", "nvidia.com/gpu", None),
        (("nvidiaCompatible=true",), nvidia_compat.DRIVER_NAME, "nvidia.com/gpu", None),
        (("driverName=example.org",), "example.org", "nvidia.com/gpu", None),
        (
            (
                "deviceClasses.gpu.extendedResourceName=",
                "deviceClasses.mig.extendedResourceName=example.com/mig",
            ),
            "gpu.dra-gpu.io",
            None,
            "example.com/mig",
        ),
    ],
    ids=["default", "nvidia-compatible", "driver-name-without-gpu-prefix", "extended-resource-names"],
)
def test_the_python_classes_are_the_rendered_ones(
    render: Render, sets: tuple[str, ...], driver: str, gpu_extended: str | None, mig_extended: str | None
) -> None:
    rendered = essentials(by_kind(render(*sets), "DeviceClass"))
    assert rendered == essentials(chart_device_classes(driver, gpu_extended, mig_extended))


def test_nvidia_compatible_classes_are_nvidias() -> None:
    reference = nvidia_selectors()
    mine = {c["metadata"]["name"]: c for c in chart_device_classes(nvidia_compat.DRIVER_NAME)}
    assert set(mine) == {nvidia_compat.GPU_CLASS, nvidia_compat.MIG_CLASS}
    for name, cls in mine.items():
        (selector,) = cls["spec"]["selectors"]
        assert selector["cel"]["expression"] == reference[name], name
    assert (
        mine[nvidia_compat.GPU_CLASS]["spec"]["extendedResourceName"] == nvidia_compat.GPU_EXTENDED_RESOURCE
    )
    # The classes dra-gpu refuses are the rest of NVIDIA's chart (and the demos' imex.nvidia.com).
    assert set(reference) - set(mine) <= set(nvidia_compat.UNSUPPORTED_CLASSES)


@pytest.mark.parametrize(
    ("file", "sets", "driver"),
    [
        ("dra-gpu.yaml", (), "gpu.dra-gpu.io"),
        ("nvidia-compatible.yaml", ("nvidiaCompatible=true",), "gpu.nvidia.com"),
    ],
)
def test_the_plain_manifests_are_the_charts_classes(
    render: Render, file: str, sets: tuple[str, ...], driver: str
) -> None:
    """deploy/device-classes/ for `kubectl apply -f` without the chart: the objects the model has,
    and what the chart renders with its defaults."""
    plain = list(yaml.safe_load_all((ROOT / "deploy" / "device-classes" / file).read_text()))
    assert plain == chart_device_classes(driver)
    assert essentials(plain) == essentials(by_kind(render(*sets), "DeviceClass"))
