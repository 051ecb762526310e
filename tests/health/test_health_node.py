"""The health half of the plugin on a simulated node, end to end without Kubernetes: events
injected through the control socket (as `dra-gpu health simulate` does) go into the simulated
kernel, reach the monitor through the simulated libnvidia-ml.so.1 (nvmlEventSetWait_v2,
GPU_IS_LOST, the recovery-action field) and become taints, kubelet health and metrics, and clear
after recovery and the hold-down. One simulated NVML per process: each test runs in a child."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from dra_gpu.cli import main
from dra_gpu.health.control import SOCKET_NAME, request
from dra_gpu.health.node import HealthConfig, HealthNode
from dra_gpu.health.taint_book import HoldDown
from dra_gpu.node.backend import open_backend
from dra_gpu.node.catalog import DeviceCatalog
from tests.simnode_support import in_child, needs_root, needs_toolchain, nvml_h  # noqa: F401 - a fixture

DRIVER = "gpu.dra-gpu.io"
KEY = f"{DRIVER}/unhealthy"


class Node:
    def __init__(self, health: HealthNode, registry: CollectorRegistry, plugin_dir: Path) -> None:
        self.health, self.registry, self.plugin_dir = health, registry, plugin_dir
        self.changes = 0

    async def changed(self) -> None:
        self.changes += 1

    async def ask(self, **body: Any) -> dict[str, Any]:
        reply = await asyncio.to_thread(request, self.plugin_dir / SOCKET_NAME, body)
        assert reply["ok"], reply
        return reply

    async def until(self, what: str, check: Any, timeout: float = 3.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            await asyncio.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}")

    def taints(self) -> dict[str, list[dict[str, object]]]:
        return self.health.manager.slice_taints()

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


async def start(profile: str, plugin_dir: Path, hold: float = 0.3) -> Node:
    registry = CollectorRegistry()
    cfg = HealthConfig(
        check_interval=0.05, hold_down=HoldDown(initial=hold, maximum=4 * hold, flap_window=10)
    )
    backend = open_backend(profile, None, plugin_dir / "simulated-root")  # the node's one NVML
    inventory = backend.discover("node-a")
    health = HealthNode(
        cfg, DRIVER, DeviceCatalog.build(inventory), plugin_dir, registry, backend.nvml, backend.events
    )
    node = Node(health, registry, plugin_dir)
    health.subscribe(node.changed)
    await health.start()
    return node


def run_async(fn: Callable[[Path], Awaitable[None]], tmp_path: Path) -> None:
    asyncio.run(fn(tmp_path))  # type: ignore[arg-type]


def on_hgx(tmp_path: Path, body: Callable[[Node], Awaitable[None]]) -> None:
    """Run `body` against a started hgx-2x4 health node, in a child (no pytest-asyncio here)."""
    in_child(_on_hgx, tmp_path, body)


def _on_hgx(tmp_path: Path, body: Callable[[Node], Awaitable[None]]) -> None:

    async def run() -> None:
        node = await start("hgx-2x4", tmp_path)
        try:
            await body(node)
        finally:
            await node.health.stop()

    asyncio.run(run())


GPU2 = "gpu-0000-2a-00-0"


@pytest.mark.usefixtures("nvml_h")
@needs_root
@needs_toolchain
def test_xid_79_taints_no_execute_and_clears_after_recovery_and_hold_down(tmp_path: Path) -> None:
    on_hgx(tmp_path, _xid_79_taints_no_execute_and_clears_after_recovery_and_hold_down)


async def _xid_79_taints_no_execute_and_clears_after_recovery_and_hold_down(hgx: Node) -> None:
    reply = await hgx.ask(op="simulate", event="xid", gpu="2", xid=79)
    assert reply["device"] in hgx.health.manager.device_names()
    gpu2 = reply["device"]
    t0 = time.monotonic()
    taints = await hgx.until("the taint", lambda: hgx.taints().get(gpu2))
    assert time.monotonic() - t0 < 1.0
    assert taints[0]["key"] == KEY and taints[0]["value"] == "xid-79" and taints[0]["effect"] == "NoExecute"
    assert list(hgx.taints()) == [gpu2]
    healthy, message = hgx.health.manager.health()[gpu2]
    assert not healthy and "XID 79" in message
    assert hgx.metric("dra_gpu_xid_events_total", xid="79") == 1
    assert hgx.metric("dra_gpu_device_healthy", device=gpu2) == 0
    # Lost (fell off the bus): no amount of waiting clears it.
    await asyncio.sleep(0.6)
    assert gpu2 in hgx.taints()
    await hgx.ask(op="simulate", event="recover", gpu=gpu2)
    await hgx.until("the taint to go after the hold-down", lambda: not hgx.taints(), timeout=3)
    assert hgx.metric("dra_gpu_taint_transitions_total", device=gpu2, action="removed", effect="") == 1
    assert hgx.metric("dra_gpu_device_healthy", device=gpu2) == 1
    assert hgx.health.manager.health()[gpu2] == (True, "")


@pytest.mark.usefixtures("nvml_h")
@needs_root
@needs_toolchain
def test_application_xid_is_counted_not_tainted(tmp_path: Path) -> None:
    on_hgx(tmp_path, _application_xid_is_counted_not_tainted)


async def _application_xid_is_counted_not_tainted(hgx: Node) -> None:
    await hgx.ask(op="simulate", event="xid", gpu="1", xid=13)
    await hgx.until("the count", lambda: hgx.metric("dra_gpu_xid_events_total", xid="13") == 1)
    await asyncio.sleep(0.2)
    assert hgx.taints() == {}


@pytest.mark.usefixtures("nvml_h")
@needs_root
@needs_toolchain
def test_a_recovery_action_taints_with_the_action_nvml_reports(tmp_path: Path) -> None:
    on_hgx(tmp_path, _a_recovery_action_taints_with_the_action_nvml_reports)


async def _a_recovery_action_taints_with_the_action_nvml_reports(hgx: Node) -> None:
    # nvml.h: the event's eventData is 0 (only XIDs carry data); the action is NVML's field.
    reply = await hgx.ask(op="simulate", event="recovery-action", gpu="1", action="gpu-reset")
    dev = reply["device"]
    taints = await hgx.until("the recovery-action taint", lambda: hgx.taints().get(dev))
    assert taints[0]["value"] == "recovery-gpu-reset" and taints[0]["effect"] == "NoSchedule"
    await hgx.ask(op="simulate", event="recover", gpu="1")  # the GPU was reset: no action pending
    await hgx.until("the taint to go after the hold-down", lambda: not hgx.taints(), timeout=3)


@pytest.mark.usefixtures("nvml_h")
@needs_root
@needs_toolchain
def test_ecc_and_operator_override(tmp_path: Path) -> None:
    on_hgx(tmp_path, _ecc_and_operator_override)


async def _ecc_and_operator_override(hgx: Node) -> None:
    reply = await hgx.ask(op="simulate", event="ecc", gpu="0")
    dev = reply["device"]
    taints = await hgx.until("the ECC taint", lambda: hgx.taints().get(dev))
    assert taints[0]["value"] == "ecc-dbe" and taints[0]["effect"] == "NoExecute"
    await asyncio.sleep(0.5)
    assert dev in hgx.taints()  # the recovery action (GPU reset) is pending: kept
    assert (await hgx.ask(op="clear", device=dev))["wasTainted"]
    assert dev not in hgx.taints()
    await hgx.ask(op="taint", device="gpu-0000-18-00-0", effect="NoSchedule", cause="maintenance")
    status = {d["device"]: d for d in (await hgx.ask(op="status"))["devices"]}
    assert status["gpu-0000-18-00-0"]["taint"] == f"{KEY}=maintenance:NoSchedule"
    assert status["gpu-0000-18-00-0"]["forced"]
    bad = await asyncio.to_thread(request, hgx.plugin_dir / SOCKET_NAME, {"op": "clear", "device": "nope"})
    assert not bad["ok"] and "nope" in bad["error"]


@pytest.mark.usefixtures("nvml_h")
@needs_root
@needs_toolchain
def test_mig_events_taint_the_mig_device_or_all_of_the_parent(tmp_path: Path) -> None:
    in_child(run_async, _mig_events_taint_the_mig_device_or_all_of_the_parent, tmp_path)


async def _mig_events_taint_the_mig_device_or_all_of_the_parent(tmp_path: Path) -> None:
    node = await start("dgx-a100-mig", tmp_path)
    try:
        await node.ask(op="simulate", event="xid", gpu="gpu-0000-0f-00-0-mig-1g10gb-4", xid=74)
        await node.until("the MIG taint", lambda: node.taints())
        assert list(node.taints()) == ["gpu-0000-0f-00-0-mig-1g10gb-4"]
        await node.ask(op="simulate", event="xid", gpu="0", xid=48)
        await node.until("the parent's MIG devices", lambda: len(node.taints()) == 3)
        assert sorted(node.taints()) == [
            "gpu-0000-07-00-0-mig-3g40gb-0",
            "gpu-0000-07-00-0-mig-3g40gb-4",
            "gpu-0000-0f-00-0-mig-1g10gb-4",
        ]
    finally:
        await node.health.stop()


@pytest.mark.usefixtures("nvml_h")
@needs_root
@needs_toolchain
def test_taints_survive_a_restart(tmp_path: Path) -> None:
    in_child(run_async, _taints_survive_a_restart, tmp_path)


async def _taints_survive_a_restart(tmp_path: Path) -> None:
    node = await start("hgx-2x4", tmp_path, hold=0.5)
    # XID 92 taints and asks for no recovery action (74 would: a GPU reset pending in the
    # simulated kernel keeps a device unhealthy across the restart, as on a real node).
    await node.ask(op="simulate", event="xid", gpu="3", xid=92)
    await node.until("the taint", lambda: node.taints())
    await node.health.stop()
    again = await start("hgx-2x4", tmp_path, hold=0.5)
    try:
        assert list(again.taints()) == list(node.taints())
        await asyncio.sleep(0.3)
        assert again.taints()  # the hold-down started again at the restart
        await again.until("the hold-down to pass", lambda: not again.taints(), timeout=3)
    finally:
        await again.health.stop()


def test_cli_says_when_no_plugin_answers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["health", "--plugin-dir", str(tmp_path), "status"]) == 2
    assert "no plugin answers" in capsys.readouterr().err
