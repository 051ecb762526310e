"""NVIDIA-compatible mode in the rules, the webhook and `dra-gpu controller`: a request for one of
NVIDIA's classes dra-gpu has no devices for (VFIO, ComputeDomains), or a config for NVIDIA's
compute-domain driver, is refused naming the field and the reason; not in the default mode, and not
when that class or driver is there (NVIDIA's other driver runs beside this one)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml
from simnode.fake import discover_node

from dra_gpu.controller import commands
from dra_gpu.controller.cluster_state import ClusterState
from dra_gpu.controller.rules import Validator, Verdict
from dra_gpu.model import nvidia_compat
from dra_gpu.model.device_classes import chart_device_classes
from dra_gpu.node.slices import build_slices

from .test_webhook import Server

DRIVER = nvidia_compat.DRIVER_NAME
CD_DRIVER = next(iter(nvidia_compat.UNSUPPORTED_DRIVERS))
CLASSES = chart_device_classes(DRIVER)


def nvidia_slices() -> list[dict[str, Any]]:
    return build_slices(discover_node("node-a", "dgx-h100"), DRIVER)


def template(*requests: dict[str, Any], config: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": list(requests)}
    if config:
        devices["config"] = config
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "t", "namespace": "default"},
        "spec": {"spec": {"devices": devices}},
    }


def exactly(name: str, cls: str) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": cls}}


def channel_config(driver: str = CD_DRIVER) -> dict[str, Any]:
    params = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomainChannelConfig",
        "domainID": "d1",
    }
    return {"requests": ["ch"], "opaque": {"driver": driver, "parameters": params}}


def errors(v: Verdict) -> dict[str, str]:
    return {p.path: p.message for p in v.errors}


@pytest.mark.parametrize("cls", sorted(nvidia_compat.UNSUPPORTED_CLASSES))
def test_a_request_for_an_unsupported_class_is_refused_with_its_reason(cls: str) -> None:
    v = Validator(DRIVER, nvidia_slices(), CLASSES, nvidia_compatible=True)
    verdict = v.validate(template(exactly("gpu", cls)))
    reason = nvidia_compat.unsupported_reason(cls)
    assert reason and errors(verdict) == {"spec.spec.devices.requests[0].exactly.deviceClassName": reason}


def test_a_subrequest_for_an_unsupported_class_is_refused_at_its_path() -> None:
    first = {
        "name": "gpu",
        "firstAvailable": [
            {"name": "whole", "deviceClassName": DRIVER},
            {"name": "vm", "deviceClassName": "vfio.gpu.nvidia.com"},
        ],
    }
    verdict = Validator(DRIVER, nvidia_slices(), CLASSES, nvidia_compatible=True).validate(template(first))
    assert list(errors(verdict)) == ["spec.spec.devices.requests[0].firstAvailable[1].deviceClassName"]
    assert "VFIO passthrough" in verdict.errors[0].message


def test_a_config_for_the_compute_domain_driver_is_refused() -> None:
    obj = template(exactly("ch", "compute-domain-default-channel.nvidia.com"), config=[channel_config()])
    verdict = Validator(DRIVER, nvidia_slices(), CLASSES, nvidia_compatible=True).validate(obj)
    found = errors(verdict)
    assert set(found) == {
        "spec.spec.devices.requests[0].exactly.deviceClassName",
        "spec.spec.devices.config[0].opaque.driver",
    }
    assert found["spec.spec.devices.config[0].opaque.driver"].startswith(f"driver {CD_DRIVER} is NVIDIA's")


def test_default_mode_refuses_none_of_it() -> None:
    obj = template(
        exactly("gpu", "vfio.gpu.nvidia.com"),
        exactly("ch", "compute-domain-default-channel.nvidia.com"),
        config=[channel_config()],
    )
    # The same driver name without the mode (a library caller): the rules alone decide nothing.
    assert Validator(DRIVER, nvidia_slices(), CLASSES).validate(obj).errors == []
    assert Validator("gpu.dra-gpu.io", nvidia_slices(), []).validate(obj).errors == []


def test_nothing_is_refused_where_nvidias_other_driver_runs() -> None:
    """Its classes exist, or it publishes slices: it serves these claims, not dra-gpu."""
    cd_class = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "compute-domain-default-channel.nvidia.com"},
        "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{CD_DRIVER}'"}}]},
    }
    obj = template(exactly("ch", "compute-domain-default-channel.nvidia.com"), config=[channel_config()])
    with_class = Validator(DRIVER, nvidia_slices(), [*CLASSES, cd_class], nvidia_compatible=True)
    assert with_class.validate(obj).errors == []
    cd_slice = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "cd-node-a"},
        "spec": {
            "driver": CD_DRIVER,
            "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
            "devices": [],
        },
    }
    only_config = template(exactly("ch", DRIVER), config=[channel_config()])
    with_slices = Validator(DRIVER, [*nvidia_slices(), cd_slice], CLASSES, nvidia_compatible=True)
    assert with_slices.validate(only_config).errors == []
    # Without them, the same config is refused: the slice was what allowed it.
    alone = Validator(DRIVER, nvidia_slices(), CLASSES, nvidia_compatible=True)
    assert list(errors(alone.validate(only_config))) == ["spec.spec.devices.config[0].opaque.driver"]


def test_an_existing_class_of_that_name_gets_the_ordinary_rules() -> None:
    """NVIDIA's own vfio class selects gpu.nvidia.com's type 'vfio' devices: dra-gpu, running as
    gpu.nvidia.com, publishes none, which the feasibility check says, not the refusal."""
    vfio_class = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "vfio.gpu.nvidia.com"},
        "spec": {
            "selectors": [
                {
                    "cel": {
                        "expression": f"device.driver == '{DRIVER}' && "
                        f"device.attributes['{DRIVER}'].type == 'vfio'"
                    }
                }
            ]
        },
    }
    v = Validator(DRIVER, nvidia_slices(), [*CLASSES, vfio_class], nvidia_compatible=True)
    (problem,) = v.validate(template(exactly("vm", "vfio.gpu.nvidia.com"))).errors
    assert problem.path == "spec.spec.devices"
    assert "can never be satisfied" in problem.message and "does not do" not in problem.message


def test_a_device_class_configuring_the_other_driver_is_not_refused() -> None:
    """A class is written by whoever runs the other driver: it shows the driver runs."""
    cls = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "channels"},
        "spec": {
            "selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}],
            "config": [{"opaque": channel_config()["opaque"]}],
        },
    }
    assert Validator(DRIVER, nvidia_slices(), CLASSES, nvidia_compatible=True).validate(cls).errors == []


def test_the_webhooks_view_refuses_in_nvidia_compatible_mode() -> None:
    obj = template(exactly("gpu", "vfio.gpu.nvidia.com"))
    for compatible, refused in ((True, True), (False, False)):
        state = ClusterState(DRIVER, nvidia_compatible=compatible)
        state.replace("slices", nvidia_slices())
        state.replace("classes", CLASSES)
        assert bool(state.validator().validate(obj).errors) is refused


def test_the_webhook_denies_over_https_through_its_workers(tmp_path: Path) -> None:
    """WebhookConfig.nvidia_compatible reaches the review workers (forked from the template)."""
    cluster = tmp_path / "nvidia-cluster.yaml"
    cluster.write_text(yaml.safe_dump_all([*nvidia_slices(), *CLASSES]))
    server = Server(tmp_path, driver=DRIVER, nvidia_compatible=True, files=(str(cluster),))
    try:
        denied = server.review(template(exactly("gpu", "vfio.gpu.nvidia.com")))
        assert denied["allowed"] is False
        assert denied["status"]["message"] == (
            "spec.spec.devices.requests[0].exactly.deviceClassName: "
            + str(nvidia_compat.unsupported_reason("vfio.gpu.nvidia.com"))
        )
        assert server.review(template(exactly("gpu", DRIVER)))["allowed"] is True
    finally:
        server.stop()


def controller_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    handlers = commands.add_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["controller", "--cert", "c", "--key", "k", *argv])
    args.handler = handlers["controller"]
    return args


@pytest.mark.parametrize(
    ("argv", "driver", "compatible"),
    [
        ((), "gpu.dra-gpu.io", False),
        (("--nvidia-compatible",), DRIVER, True),
        (("--nvidia-compatible", "--driver-name", DRIVER), DRIVER, True),
        # The chart's NVIDIA-compatible mode passes the driver name alone.
        (("--driver-name", DRIVER), DRIVER, True),
        (("--driver-name", "gpu.example.com"), "gpu.example.com", False),
    ],
)
def test_controller_runs_the_webhook_in_the_mode_its_flags_say(
    monkeypatch: pytest.MonkeyPatch, argv: tuple[str, ...], driver: str, compatible: bool
) -> None:
    from dra_gpu.controller import webhook

    seen: list[webhook.WebhookConfig] = []

    def run(config: webhook.WebhookConfig) -> int:
        seen.append(config)
        return 0

    monkeypatch.setattr(webhook, "run", run)
    args = controller_args(*argv)
    assert args.handler(args) == 0
    assert (seen[0].driver, seen[0].nvidia_compatible) == (driver, compatible)


def test_controller_refuses_contradicting_flags(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from dra_gpu.common.exit_codes import EXIT_USAGE
    from dra_gpu.controller import webhook

    monkeypatch.setattr(webhook, "run", lambda config: pytest.fail("must not serve"))
    args = controller_args("--nvidia-compatible", "--driver-name", "gpu.dra-gpu.io")
    assert args.handler(args) == EXIT_USAGE
    assert "contradicts --nvidia-compatible" in capsys.readouterr().err
