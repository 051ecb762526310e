"""The monitor's threads: events, lost GPUs, GPUs whose events cannot be registered."""

from __future__ import annotations

import threading
import time
from typing import Any

import pynvml
from simnode.fake import FakeNvml
from simnode.profiles import load_profile

from dra_gpu.health.classification import EventKind
from dra_gpu.health.monitor import Monitor, Observation, Seen
from dra_gpu.node.catalog import DeviceCatalog


class NoEvents(FakeNvml):
    def nvmlDeviceRegisterEvents(self, handle: Any, mask: int, event_set: Any) -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


def watch(nvml: FakeNvml, seconds: float) -> list[Observation]:
    seen: list[Observation] = []
    lock = threading.Lock()

    def sink(obs: Observation) -> None:
        with lock:
            seen.append(obs)

    uuids = [g.uuid for g in nvml.profile.gpus[:2]]
    monitor = Monitor(nvml, uuids, sink, interval=0.05)
    monitor.start()
    time.sleep(0.2)
    nvml.inject_event(uuids[0], pynvml.nvmlEventTypeXidCriticalError, 94)
    nvml.set_lost(uuids[1], True)
    time.sleep(seconds)
    monitor.stop()
    assert not any(w.thread.is_alive() for w in monitor.watchers)
    return seen


def test_events_liveness_and_lost_gpus() -> None:
    nvml = FakeNvml(load_profile("hgx-2x4"))
    nvml.nvmlInit()
    seen = watch(nvml, 0.3)
    first, second = (g.uuid for g in nvml.profile.gpus[:2])
    events = [o for o in seen if o.seen is Seen.EVENT]
    assert [(o.gpu_uuid, o.kind, o.data) for o in events] == [(first, EventKind.XID, 94)]
    assert any(o.seen is Seen.ALIVE and o.gpu_uuid == first and o.recovery_action == 0 for o in seen)
    assert any(o.seen is Seen.LOST and o.gpu_uuid == second for o in seen)


def test_a_gpu_without_events_is_still_checked() -> None:
    nvml = NoEvents(load_profile("hgx-2x4"))
    nvml.nvmlInit()
    seen = watch(nvml, 0.2)
    first = nvml.profile.gpus[0].uuid
    assert [o.seen for o in seen if o.gpu_uuid == first].count(Seen.UNMONITORED) == 1
    assert sum(o.seen is Seen.ALIVE and o.gpu_uuid == first for o in seen) >= 2
    assert not any(o.seen is Seen.EVENT for o in seen)


class Flaky(FakeNvml):
    """The first GPU's event waits and memory queries answer NVML_ERROR_UNKNOWN `failures` times
    (a driver hiccup), then work again."""

    def __init__(self, *args: Any, failures: int = 4, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.flaky = self.profile.gpus[0].uuid
        self.left = {"wait": failures, "memory": 2}
        self.flaky_sets: set[int] = set()

    def _fail(self, what: str) -> None:
        if self.left[what] > 0:
            self.left[what] -= 1
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    def nvmlDeviceRegisterEvents(self, handle: Any, mask: int, event_set: Any) -> None:
        super().nvmlDeviceRegisterEvents(handle, mask, event_set)
        if handle.spec.uuid == self.flaky:
            self.flaky_sets.add(id(event_set))

    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int) -> Any:
        if id(event_set) in self.flaky_sets:
            self._fail("wait")
        return super().nvmlEventSetWait(event_set, timeout_ms)

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        if handle.spec.uuid == self.flaky:
            self._fail("memory")
        return super().nvmlDeviceGetMemoryInfo(handle)


def test_only_a_lost_gpu_taints_other_nvml_errors_are_retried_and_counted() -> None:
    """NVML_ERROR_UNKNOWN from the event wait and the liveness query is not a lost GPU: no taint
    (a NoExecute taint would evict the pods), the call retried and counted; an event sent after
    the errors still arrives. GPU_IS_LOST taints NoExecute."""
    from prometheus_client import CollectorRegistry
    from simnode.fake import discover_node

    from dra_gpu.health.classification import Classifier, Effect
    from dra_gpu.health.manager import HealthManager
    from dra_gpu.health.taint_book import TaintBook

    inv = discover_node("node-a", "hgx-2x4")
    registry = CollectorRegistry()
    names = [g.device_name for g in inv.gpus]
    manager = HealthManager(
        DeviceCatalog.build(inv), "gpu.dra-gpu.io/unhealthy", TaintBook(None, names), Classifier(), registry
    )
    nvml = Flaky(load_profile("hgx-2x4"))
    nvml.nvmlInit()
    first, second = (g.uuid for g in nvml.profile.gpus[:2])
    lock = threading.Lock()

    def sink(obs: Observation) -> None:
        with lock:
            manager.handle(obs)

    monitor = Monitor(nvml, [first, second], sink, interval=0.05)
    monitor.start()
    try:
        deadline = time.monotonic() + 10
        while (nvml.left["wait"] or nvml.left["memory"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert nvml.left == {"wait": 0, "memory": 0}
        time.sleep(0.3)  # past the backoff: waiting again
        assert nvml.inject_event(first, pynvml.nvmlEventTypeXidCriticalError, 31) == 1  # counted only
        nvml.set_lost(second, True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with lock:
                xids = registry.get_sample_value("dra_gpu_xid_events_total", {"xid": "31"})
                if names[1] in manager.book.tainted() and xids:
                    break
            time.sleep(0.02)
    finally:
        monitor.stop()
    tainted = manager.book.tainted()
    assert names[0] not in tainted, tainted[names[0]]
    assert tainted[names[1]].effect is Effect.NO_EXECUTE and tainted[names[1]].cause == "gpu-lost"
    assert manager.lost == {second}
    assert registry.get_sample_value("dra_gpu_xid_events_total", {"xid": "31"}) == 1
    count = registry.get_sample_value
    assert count("dra_gpu_health_nvml_errors_total", {"call": "event-wait", "error": "unknown"}) == 4
    assert count("dra_gpu_health_nvml_errors_total", {"call": "liveness", "error": "unknown"}) == 2
